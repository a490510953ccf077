"""The zoo: LightningModules that lightning_accel did not design, at tiny sizes, on small synthetic data of the shapes
their own data has.

Lightning's shipped demos (`lightning.pytorch.demos`: `BoringModel`, `LightningLSTM`, `LightningTransformer`) are
imported and trained unchanged; only their data is ours (they download WikiText-2). Lightning's examples and
tutorials are not installed by any package, and this project keeps other repositories' code out of its own files, so
each of them is written here again after the original's structure: the same hooks, the same kind of state, the same
optimizers and schedules, in the original's own idiom (its `training_step` side effects, its `self.hparams`, its
`estimated_stepping_batches`), with the sizes cut down. Each class names what it follows:

- `boring`: `lightning.pytorch.demos.BoringModel`, unchanged: the plainest module, a validation loop;
- `lstm`: `lightning.pytorch.demos.LightningLSTM`, unchanged: an RNN that keeps its hidden state on `self`;
- `transformer`: `lightning.pytorch.demos.LightningTransformer`, unchanged: dropout, a mask and a positional table
  cached on `self`;
- `gan`: after `examples/pytorch/domain_templates/generative_adversarial_net.py`: manual optimization, two
  optimizers, BatchNorm;
- `dqn`: after `examples/pytorch/domain_templates/reinforce_learn_Qnet.py`: an IterableDataset over a replay buffer
  that `training_step` fills with an environment step per call;
- `finetune`: after `examples/pytorch/domain_templates/computer_vision_fine_tuning.py`: BatchNorm, a fine-tuning
  callback that adds a param group during the fit, MultiStepLR;
- `glue`: after Lightning-AI/tutorials `lightning_examples/text-transformers`: dict batches, two validation loaders,
  a linear warm-up and decay sized by `estimated_stepping_batches`;
- `autoencoder`: after `examples/pytorch/basics/autoencoder.py`: an encoder-decoder with validation;
- `resnet`: after `examples/pytorch/domain_templates/imagenet.py` over torchvision's `resnet` (BSD-3): BatchNorm2d,
  residual blocks, SGD with an epoch LambdaLR, top-k accuracy.

Lightning and its tutorials are Apache-2.0, The Lightning AI team.

Each entry is a `ZooEntry`: a builder of the module and its loaders (the same ones for the same seed), plus what the
zoo must know to train it (its validation key, the batch size, extra Trainer callbacks such as the fine-tuning one).
"""

from __future__ import annotations

import math
import random
from collections import deque, namedtuple
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks.finetuning import BaseFinetuning
from lightning.pytorch.demos import BoringModel, LightningLSTM, LightningTransformer
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

BATCH = 8
"""Every loader's batch size (the micro-batch cells split it in two)."""


@dataclass
class ZooEntry:
    """One module of the zoo and how it is trained."""

    name: str
    build: Callable[[], tuple[pl.LightningModule, dict[str, Any]]]
    """-> (module, `trainer.fit` keyword arguments: its loaders, or none when the module makes its own)."""
    follows: str
    val_key: str | None = None
    """The validation metric it logs (what a ModelCheckpoint would monitor); None: it logs none."""
    callbacks: Callable[[], list[pl.Callback]] = list
    """Callbacks the original trains with (the fine-tuning one); the zoo adds them to every fit."""
    max_epochs: int = 2
    covers: tuple[str, ...] = field(default_factory=tuple)


def _tokens(n: int, seq: int, vocab: int, seed: int) -> TensorDataset:
    """`n` (input, next-token target) pairs of `seq` tokens, a cyclic sequence with noise: learnable, not trivial."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, vocab, (n, 1), generator=gen)
    steps = torch.arange(seq + 1).unsqueeze(0)
    stream = (starts + steps * 3 + torch.randint(0, 2, (n, seq + 1), generator=gen)) % vocab
    return TensorDataset(stream[:, :-1].contiguous(), stream[:, 1:].contiguous())


# -- Lightning's demos, unchanged ---------------------------------------------------------------------------------


def build_boring() -> tuple[pl.LightningModule, dict[str, Any]]:
    # BoringModel's own loaders: RandomDataset(32, 64) in batches of 2; the zoo's in batches of BATCH
    gen = torch.Generator().manual_seed(1)
    train = DataLoader(TensorDataset(torch.randn(4 * BATCH, 32, generator=gen)), batch_size=BATCH)
    val = DataLoader(TensorDataset(torch.randn(BATCH, 32, generator=gen)), batch_size=BATCH)
    return _Boring(), {"train_dataloaders": train, "val_dataloaders": val}


class _Boring(BoringModel):
    """BoringModel takes a bare tensor batch; a TensorDataset yields a one-tuple. Nothing else differs."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return super().training_step(batch[0] if isinstance(batch, (list, tuple)) else batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().validation_step(batch[0] if isinstance(batch, (list, tuple)) else batch, batch_idx)
        self.log("val_loss", out["x"])
        return out


class _Offline:
    """The demos' `prepare_data` downloads WikiText-2; the zoo passes its own loaders, so nothing is fetched."""

    def prepare_data(self) -> None:
        pass


class _LSTM(_Offline, LightningLSTM):
    pass


class _Transformer(_Offline, LightningTransformer):
    pass


def build_lstm() -> tuple[pl.LightningModule, dict[str, Any]]:
    # LightningLSTM builds a 4-layer LSTM of 512 units; WikiText-2 is replaced by 4 batches of 6-token sequences
    module = _LSTM(vocab_size=24)
    train = DataLoader(_tokens(4 * BATCH, 6, 24, seed=2), batch_size=BATCH)
    return module, {"train_dataloaders": train}


def build_transformer() -> tuple[pl.LightningModule, dict[str, Any]]:
    module = _Transformer(vocab_size=24)
    train = DataLoader(_tokens(4 * BATCH, 6, 24, seed=3), batch_size=BATCH)
    return module, {"train_dataloaders": train}


# -- after examples/pytorch/domain_templates/generative_adversarial_net.py ----------------------------------------


class Generator(nn.Module):
    def __init__(self, latent_dim: int = 8, img_shape: tuple[int, ...] = (1, 4, 4)) -> None:
        super().__init__()
        self.img_shape = img_shape

        def block(in_feat: int, out_feat: int, normalize: bool = True) -> list[nn.Module]:
            layers: list[nn.Module] = [nn.Linear(in_feat, out_feat)]
            if normalize:
                layers.append(nn.BatchNorm1d(out_feat, 0.8))
            layers.append(nn.LeakyReLU(0.2, inplace=True))
            return layers

        self.model = nn.Sequential(
            *block(latent_dim, 16, normalize=False),
            *block(16, 32),
            nn.Linear(32, math.prod(img_shape)),
            nn.Tanh(),
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        img = self.model(z)
        return img.view(img.size(0), *self.img_shape)


class Discriminator(nn.Module):
    def __init__(self, img_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(math.prod(img_shape), 16), nn.LeakyReLU(0.2, inplace=True), nn.Linear(16, 1)
        )

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        return self.model(img.view(img.size(0), -1))


class GAN(pl.LightningModule):
    """Manual optimization: the generator's and the discriminator's Adam steps in one `training_step`."""

    def __init__(self, img_shape: tuple[int, ...] = (1, 4, 4), lr: float = 0.0002, latent_dim: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = Generator(latent_dim=latent_dim, img_shape=img_shape)
        self.discriminator = Discriminator(img_shape=img_shape)
        self.validation_z = torch.randn(4, latent_dim)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(z)

    @staticmethod
    def adversarial_loss(y_hat: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(y_hat, y)

    def training_step(self, batch: Any) -> None:
        imgs, _ = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(imgs.shape[0], self.hparams.latent_dim).type_as(imgs)

        self.toggle_optimizer(opt_g)
        valid = torch.ones(imgs.size(0), 1).type_as(imgs)
        g_loss = self.adversarial_loss(self.discriminator(self(z)), valid)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        real_loss = self.adversarial_loss(self.discriminator(imgs), valid)
        fake = torch.zeros(imgs.size(0), 1).type_as(imgs)
        fake_loss = self.adversarial_loss(self.discriminator(self(z).detach()), fake)
        d_loss = (real_loss + fake_loss) / 2
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)

        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})

    def configure_optimizers(self) -> Any:
        lr = self.hparams.lr
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(0.5, 0.999))
        return opt_g, opt_d


def build_gan() -> tuple[pl.LightningModule, dict[str, Any]]:
    gen = torch.Generator().manual_seed(4)
    images = torch.rand(4 * BATCH, 1, 4, 4, generator=gen) * 2 - 1
    train = DataLoader(TensorDataset(images, torch.zeros(4 * BATCH, dtype=torch.long)), batch_size=BATCH)
    return GAN(), {"train_dataloaders": train}


# -- after examples/pytorch/domain_templates/reinforce_learn_Qnet.py ----------------------------------------------


class ChainEnv:
    """A stand-in for gym's CartPole, small and deterministic: a position on a chain of `length` cells, actions left
    and right, reward 1 for each step taken to the right, the episode over at either end."""

    def __init__(self, length: int = 6) -> None:
        self.length = length
        self.position = length // 2
        self.observation_space_shape = (length,)
        self.n_actions = 2

    def observation(self) -> list[float]:
        return [1.0 if i == self.position else 0.0 for i in range(self.length)]

    def reset(self) -> list[float]:
        self.position = self.length // 2
        return self.observation()

    def step(self, action: int) -> tuple[list[float], float, bool]:
        self.position += 1 if action == 1 else -1
        done = self.position in (0, self.length - 1)
        return self.observation(), float(action == 1), done


class DQN(nn.Module):
    def __init__(self, obs_size: int, n_actions: int, hidden_size: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_size, hidden_size), nn.ReLU(), nn.Linear(hidden_size, n_actions))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.float())


Experience = namedtuple("Experience", field_names=["state", "action", "reward", "done", "new_state"])


class ReplayBuffer:
    def __init__(self, capacity: int) -> None:
        self.buffer: deque[Experience] = deque(maxlen=capacity)

    def __len__(self) -> int:
        return len(self.buffer)

    def append(self, experience: Experience) -> None:
        self.buffer.append(experience)

    def sample(self, batch_size: int) -> tuple[Any, ...]:
        indices = random.sample(range(len(self.buffer)), batch_size)
        states, actions, rewards, dones, next_states = zip(*(self.buffer[idx] for idx in indices), strict=True)
        return (
            torch.tensor(states),
            torch.tensor(actions),
            torch.tensor(rewards, dtype=torch.float32),
            torch.tensor(dones, dtype=torch.bool),
            torch.tensor(next_states),
        )


class RLDataset(IterableDataset):
    """Samples of the replay buffer, refreshed as training adds to it: no `__len__`."""

    def __init__(self, buffer: ReplayBuffer, sample_size: int = 4 * BATCH) -> None:
        self.buffer = buffer
        self.sample_size = sample_size

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        states, actions, rewards, dones, new_states = self.buffer.sample(self.sample_size)
        for i in range(len(dones)):
            yield states[i], actions[i], rewards[i], dones[i], new_states[i]


class Agent:
    def __init__(self, env: ChainEnv, replay_buffer: ReplayBuffer) -> None:
        self.env = env
        self.replay_buffer = replay_buffer
        self.state = self.env.reset()

    def get_action(self, net: nn.Module, epsilon: float) -> int:
        if random.random() < epsilon:
            return random.randrange(self.env.n_actions)
        with torch.no_grad():
            q_values = net(torch.tensor([self.state]))
        return int(torch.argmax(q_values, dim=1).item())

    @torch.no_grad()
    def play_step(self, net: nn.Module, epsilon: float = 0.0) -> tuple[float, bool]:
        action = self.get_action(net, epsilon)
        new_state, reward, done = self.env.step(action)
        self.replay_buffer.append(Experience(self.state, action, reward, done, new_state))
        self.state = new_state
        if done:
            self.state = self.env.reset()
        return reward, done


class DQNLightning(pl.LightningModule):
    """The replay buffer is filled by `training_step` itself: an environment step per call."""

    def __init__(
        self,
        replay_size: int = 64,
        warm_start_steps: int = 48,
        gamma: float = 0.9,
        eps_start: float = 1.0,
        eps_end: float = 0.05,
        eps_last_frame: int = 32,
        sync_rate: int = 4,
        lr: float = 1e-2,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.env = ChainEnv()
        self.net = DQN(self.env.length, self.env.n_actions)
        self.target_net = DQN(self.env.length, self.env.n_actions)
        self.buffer = ReplayBuffer(replay_size)
        self.agent = Agent(self.env, self.buffer)
        self.total_reward = 0.0
        self.episode_reward = 0.0
        self.populate(warm_start_steps)

    def populate(self, steps: int) -> None:
        for _ in range(steps):
            self.agent.play_step(self.net, epsilon=1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def dqn_mse_loss(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        states, actions, rewards, dones, next_states = batch
        state_action_values = self.net(states).gather(1, actions.unsqueeze(-1)).squeeze(-1)
        with torch.no_grad():
            next_state_values = self.target_net(next_states).max(1)[0]
            next_state_values[dones] = 0.0
            next_state_values = next_state_values.detach()
        expected = next_state_values * self.hparams.gamma + rewards
        return F.mse_loss(state_action_values, expected)

    def training_step(self, batch: tuple[torch.Tensor, ...], nb_batch: int) -> torch.Tensor:
        epsilon = max(self.hparams.eps_end, self.hparams.eps_start - self.global_step / self.hparams.eps_last_frame)
        reward, done = self.agent.play_step(self.net, epsilon)
        self.episode_reward += reward
        loss = self.dqn_mse_loss(batch)
        if done:
            self.total_reward = self.episode_reward
            self.episode_reward = 0.0
        if self.global_step % self.hparams.sync_rate == 0:
            self.target_net.load_state_dict(self.net.state_dict())
        self.log_dict({"reward": reward, "train_loss": loss})
        self.log("total_reward", self.total_reward)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.net.parameters(), lr=self.hparams.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RLDataset(self.buffer), batch_size=BATCH)


def build_dqn() -> tuple[pl.LightningModule, dict[str, Any]]:
    return DQNLightning(), {}


# -- after examples/pytorch/domain_templates/computer_vision_fine_tuning.py -----------------------------------------


class MilestonesFinetuning(BaseFinetuning):
    """Unfreezes the backbone at the first milestone epoch: a param group added to the optimizer during the fit."""

    def __init__(self, milestones: tuple[int, ...] = (1,), train_bn: bool = False) -> None:
        super().__init__()
        self.milestones = milestones
        self.train_bn = train_bn

    def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
        self.freeze(modules=pl_module.feature_extractor, train_bn=self.train_bn)

    def finetune_function(self, pl_module: pl.LightningModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        if epoch == self.milestones[0]:
            self.unfreeze_and_add_param_group(
                modules=pl_module.feature_extractor, optimizer=optimizer, train_bn=self.train_bn
            )


def _backbone() -> nn.Sequential:
    """A small stand-in for the example's pretrained ResNet50 feature extractor (conv, BatchNorm, pooling)."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.Conv2d(8, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
    )


class TransferLearningModel(pl.LightningModule):
    def __init__(self, lr: float = 1e-2, lr_scheduler_gamma: float = 0.5, milestones: tuple[int, ...] = (1,)) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.feature_extractor = _backbone()
        self.fc = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Dropout(0.25), nn.Linear(8, 1))
        self.loss_func = F.binary_cross_entropy_with_logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.feature_extractor(x).flatten(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        y_logits = self.forward(x)
        loss = self.loss_func(y_logits, y.view((-1, 1)).type_as(x))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        y_logits = self.forward(x)
        self.log("val_loss", self.loss_func(y_logits, y.view((-1, 1)).type_as(x)), prog_bar=True)
        self.log("val_acc", ((y_logits.sigmoid() > 0.5).long().view(-1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self) -> Any:
        parameters = list(self.parameters())
        trainable = list(filter(lambda p: p.requires_grad, parameters))
        optimizer = torch.optim.Adam(trainable, lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.MultiStepLR(
            optimizer, milestones=list(self.hparams.milestones), gamma=self.hparams.lr_scheduler_gamma
        )
        return [optimizer], [scheduler]


def build_finetune() -> tuple[pl.LightningModule, dict[str, Any]]:
    gen = torch.Generator().manual_seed(5)
    images = torch.randn(5 * BATCH, 3, 6, 6, generator=gen)
    labels = (images.mean(dim=(1, 2, 3)) > 0).long()
    train = DataLoader(TensorDataset(images[: 4 * BATCH], labels[: 4 * BATCH]), batch_size=BATCH)
    val = DataLoader(TensorDataset(images[4 * BATCH :], labels[4 * BATCH :]), batch_size=BATCH)
    return TransferLearningModel(), {"train_dataloaders": train, "val_dataloaders": val}


# -- after Lightning-AI/tutorials lightning_examples/text-transformers (GLUE) --------------------------------------


class TinyEncoderClassifier(nn.Module):
    """A stand-in for `AutoModelForSequenceClassification`: embeddings, one encoder layer, a classifier; returns
    `(loss, logits)` as the Hugging Face model's output tuple does when given `labels`."""

    def __init__(self, vocab: int = 32, dim: int = 16, num_labels: int = 3) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(vocab, dim)
        self.encoder = nn.TransformerEncoderLayer(dim, 2, 32, dropout=0.1, batch_first=True)
        self.LayerNorm = nn.LayerNorm(dim)
        self.classifier = nn.Linear(dim, num_labels)
        self.num_labels = num_labels

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...]:
        hidden = self.encoder(self.embeddings(input_ids), src_key_padding_mask=attention_mask == 0)
        pooled = self.LayerNorm(hidden[:, 0])
        logits = self.classifier(pooled)
        if labels is None:
            return (logits,)
        return F.cross_entropy(logits, labels), logits


class GLUETransformer(pl.LightningModule):
    """MNLI: dict batches, a matched and a mismatched validation loader, AdamW without weight decay on biases and
    LayerNorm weights, and a linear warm-up then decay sized by `trainer.estimated_stepping_batches`."""

    def __init__(
        self,
        num_labels: int = 3,
        learning_rate: float = 2e-3,
        adam_epsilon: float = 1e-8,
        warmup_steps: int = 1,
        weight_decay: float = 0.01,
        eval_splits: tuple[str, ...] = ("validation_matched", "validation_mismatched"),
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = TinyEncoderClassifier(num_labels=num_labels)
        self.outputs: dict[int, list[dict[str, torch.Tensor]]] = {}

    def forward(self, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.model(**inputs)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        outputs = self(**batch)
        loss = outputs[0]
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        val_loss, logits = self(**batch)[:2]
        preds = torch.argmax(logits, dim=1)
        self.outputs.setdefault(dataloader_idx, []).append(
            {"loss": val_loss, "preds": preds, "labels": batch["labels"]}
        )

    def on_validation_epoch_end(self) -> None:
        for i, outputs in self.outputs.items():
            split = self.hparams.eval_splits[i].split("_")[-1]
            preds = torch.cat([x["preds"] for x in outputs])
            labels = torch.cat([x["labels"] for x in outputs])
            loss = torch.stack([x["loss"] for x in outputs]).mean()
            self.log(f"val_loss_{split}", loss, prog_bar=True)
            self.log(f"accuracy_{split}", (preds == labels).float().mean(), prog_bar=True)
        self.outputs.clear()

    def configure_optimizers(self) -> Any:
        model = self.model
        no_decay = ["bias", "LayerNorm.weight"]
        grouped = [
            {
                "params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
                "weight_decay": self.hparams.weight_decay,
            },
            {
                "params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
                "weight_decay": 0.0,
            },
        ]
        optimizer = torch.optim.AdamW(grouped, lr=self.hparams.learning_rate, eps=self.hparams.adam_epsilon)
        total = self.trainer.estimated_stepping_batches
        warmup = self.hparams.warmup_steps

        def linear_schedule_with_warmup(step: int) -> float:  # transformers' get_linear_schedule_with_warmup
            if step < warmup:
                return step / max(1, warmup)
            return max(0.0, (total - step) / max(1, total - warmup))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_schedule_with_warmup)
        return [optimizer], [{"scheduler": scheduler, "interval": "step", "frequency": 1}]


class _MNLI(Dataset):
    """Tokenised sentence pairs as the tutorial's `convert_to_features` makes them: a dict per sample."""

    def __init__(self, n: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(1, 32, (n, 10), generator=gen)
        self.attention_mask = torch.ones(n, 10, dtype=torch.long)
        self.attention_mask[:, 8:] = torch.randint(0, 2, (n, 2), generator=gen)
        self.labels = self.input_ids[:, 1] % 3

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "attention_mask": self.attention_mask[i], "labels": self.labels[i]}


def build_glue() -> tuple[pl.LightningModule, dict[str, Any]]:
    train = DataLoader(_MNLI(4 * BATCH, seed=6), batch_size=BATCH)
    val = [DataLoader(_MNLI(BATCH, seed=7), batch_size=BATCH), DataLoader(_MNLI(BATCH, seed=8), batch_size=BATCH)]
    return GLUETransformer(), {"train_dataloaders": train, "val_dataloaders": val}


# -- after examples/pytorch/basics/autoencoder.py -----------------------------------------------------------------


class LitAutoEncoder(pl.LightningModule):
    def __init__(self, hidden_dim: int = 16, learning_rate: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Sequential(nn.Linear(16, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 3))
        self.decoder = nn.Sequential(nn.Linear(3, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._common_step(batch, batch_idx, "train")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._common_step(batch, batch_idx, "val")

    def _common_step(self, batch: Any, batch_idx: int, stage: str) -> torch.Tensor:
        x = batch[0].view(batch[0].size(0), -1)
        loss = F.mse_loss(x, self(x))
        self.log(f"{stage}_loss", loss, on_step=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)


def build_autoencoder() -> tuple[pl.LightningModule, dict[str, Any]]:
    gen = torch.Generator().manual_seed(9)
    images = torch.rand(5 * BATCH, 1, 4, 4, generator=gen)
    train = DataLoader(TensorDataset(images[: 4 * BATCH]), batch_size=BATCH)
    val = DataLoader(TensorDataset(images[4 * BATCH :]), batch_size=BATCH)
    return LitAutoEncoder(), {"train_dataloaders": train, "val_dataloaders": val}


# -- after examples/pytorch/domain_templates/imagenet.py over a torchvision-style ResNet --------------------------


class BasicBlock(nn.Module):
    """torchvision's `BasicBlock`: two 3x3 convolutions with BatchNorm and a residual, downsampled when needed."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """torchvision's `ResNet` layout (stem, four stages of blocks, pooling, fc), at widths of 4-16 channels."""

    def __init__(self, layers: tuple[int, ...] = (1, 1, 1, 1), num_classes: int = 5, width: int = 4) -> None:
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = self._make_layer(width, layers[0])
        self.layer2 = self._make_layer(width * 2, layers[1], stride=2)
        self.layer3 = self._make_layer(width * 4, layers[2], stride=2)
        self.layer4 = self._make_layer(width * 4, layers[3], stride=1)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 4, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [BasicBlock(planes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class ImageNetLightningModel(pl.LightningModule):
    def __init__(self, lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 1e-4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = ResNet()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, target = batch
        output = self(images)
        loss_train = F.cross_entropy(output, target)
        acc1, acc5 = self.__accuracy(output, target, topk=(1, 5))
        self.log("train_loss", loss_train, on_step=True, on_epoch=True, logger=True)
        self.log("train_acc1", acc1, on_step=True, prog_bar=True, on_epoch=True, logger=True)
        self.log("train_acc5", acc5, on_step=True, on_epoch=True, logger=True)
        return loss_train

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        images, target = batch
        output = self(images)
        loss_val = F.cross_entropy(output, target)
        acc1, acc5 = self.__accuracy(output, target, topk=(1, 5))
        self.log("val_loss", loss_val, on_step=True, on_epoch=True)
        self.log("val_acc1", acc1, on_step=True, prog_bar=True, on_epoch=True)
        self.log("val_acc5", acc5, on_step=True, on_epoch=True)

    @staticmethod
    def __accuracy(output: torch.Tensor, target: torch.Tensor, topk: tuple[int, ...] = (1,)) -> list[torch.Tensor]:
        with torch.no_grad():
            maxk = max(topk)
            batch_size = target.size(0)
            _, pred = output.topk(maxk, 1, True, True)
            correct = pred.t().eq(target.view(1, -1).expand_as(pred.t()))
            return [correct[:k].reshape(-1).float().sum(0, keepdim=True).mul_(100.0 / batch_size) for k in topk]

    def configure_optimizers(self) -> Any:
        hparams = self.hparams
        optimizer = torch.optim.SGD(
            self.parameters(), lr=hparams.lr, momentum=hparams.momentum, weight_decay=hparams.weight_decay
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.1 ** (epoch // 30))
        return [optimizer], [scheduler]


def build_resnet() -> tuple[pl.LightningModule, dict[str, Any]]:
    gen = torch.Generator().manual_seed(10)
    images = torch.randn(5 * BATCH, 3, 8, 8, generator=gen)
    target = torch.randint(0, 5, (5 * BATCH,), generator=gen)
    train = DataLoader(TensorDataset(images[: 4 * BATCH], target[: 4 * BATCH]), batch_size=BATCH)
    val = DataLoader(TensorDataset(images[4 * BATCH :], target[4 * BATCH :]), batch_size=BATCH)
    return ImageNetLightningModel(), {"train_dataloaders": train, "val_dataloaders": val}


ZOO: dict[str, ZooEntry] = {
    entry.name: entry
    for entry in (
        ZooEntry("boring", build_boring, "lightning.pytorch.demos.BoringModel", val_key="val_loss"),
        ZooEntry("lstm", build_lstm, "lightning.pytorch.demos.LightningLSTM", covers=("state on self",)),
        ZooEntry("transformer", build_transformer, "lightning.pytorch.demos.LightningTransformer"),
        ZooEntry("gan", build_gan, "generative_adversarial_net.py", covers=("manual optimization",)),
        ZooEntry("dqn", build_dqn, "reinforce_learn_Qnet.py", covers=("IterableDataset", "side effects")),
        ZooEntry(
            "finetune",
            build_finetune,
            "computer_vision_fine_tuning.py",
            val_key="val_loss",
            callbacks=lambda: [MilestonesFinetuning()],
            covers=("BatchNorm", "param groups added during the fit"),
        ),
        ZooEntry(
            "glue",
            build_glue,
            "text-transformers tutorial",
            val_key="val_loss_matched",
            covers=("dict batches", "two validation loaders", "estimated_stepping_batches"),
        ),
        ZooEntry("autoencoder", build_autoencoder, "autoencoder.py", val_key="val_loss"),
        ZooEntry("resnet", build_resnet, "imagenet.py + torchvision resnet", val_key="val_loss", covers=("BatchNorm",)),
    )
}
