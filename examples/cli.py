"""A LightningCLI script with lightning_accel's callbacks and strategies, configured from YAML or the command line.

    python examples/cli.py fit --config examples/cli.yaml
    python examples/cli.py fit --config examples/cli.yaml --trainer.devices=2 --trainer.max_steps=50

Every callback and strategy of lightning_accel has flat, typed constructor arguments, so jsonargparse parses them
(`pip install "lightning_accel[cli]"` brings it).
"""

from lightning.pytorch.cli import LightningCLI

from lightning_accel.examples import GPTLanguageModel, StdlibTextDataModule


def main() -> None:
    LightningCLI(GPTLanguageModel, StdlibTextDataModule, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
