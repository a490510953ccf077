"""A lightning-hydra-template-shaped app (its train.py, cut down) using lightning_accel as README "From
lightning-hydra-template" says: four lines changed, marked `# lightning_accel`."""

from __future__ import annotations

import hydra
import lightning.pytorch as pl
from hydra.utils import instantiate
from omegaconf import DictConfig

from lightning_accel.compose import check_app_config, hydra_safe_launch, instantiate_datamodule  # lightning_accel


@hydra.main(version_base="1.3", config_path="configs", config_name="train.yaml")
def main(cfg: DictConfig) -> None:
    check_app_config(cfg)  # lightning_accel
    if cfg.get("seed") is not None:
        pl.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate_datamodule(cfg.data)  # lightning_accel (was: instantiate(cfg.data))
    model = instantiate(cfg.model)
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c and "_target_" in c]
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=False)
    with hydra_safe_launch(trainer):  # lightning_accel
        trainer.fit(model=model, datamodule=datamodule)
    if trainer.is_global_zero:
        print("RESULT", {"global_step": trainer.global_step, "precision": str(trainer.precision),
                         "world_size": trainer.world_size, "strategy": type(trainer.strategy).__name__,
                         "callbacks": sorted(type(c).__name__ for c in trainer.callbacks)})  # fmt: skip


if __name__ == "__main__":
    main()
