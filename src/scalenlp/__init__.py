"""scalenlp: transformer NLP models from one CPU to a cluster.

The Python API (the CLI is a thin layer over it)::

    import scalenlp
    cfg = scalenlp.load_config("configs/debug.toml", ["training.steps=20"])  # validated as the CLI does
    scalenlp.train(cfg, "runs/python")                                     # or scalenlp.Trainer(cfg, run_dir).fit()
    with scalenlp.LLM("runs/python") as llm:                                # serve's defaults (EngineConfig's)
        print(llm.generate("Return the", scalenlp.SamplingParams(max_tokens=20, temperature=0)))
    model, pretrained = scalenlp.load("model.gguf")                         # any checkpoint kind
    tagger = scalenlp.encoder_from_checkpoint(scalenlp.EncoderEngineConfig("runs/ner"))   # an encoder's batcher
    print(tagger.tag(["Paul flew to Paris"])); tagger.stop()                # also .run("embed"/"classify", texts)
    scalenlp.plan("llama-8b", seq=8192, global_batch=256, devices=64).layouts  # fastest layouts that fit

Names are imported on first use, so ``import scalenlp`` (and ``scalenlp --help``) stays light.
"""

import importlib
import types

__version__ = "0.1.0"

_EXPORTS = {
    "Config": "scalenlp.config", "ModelConfig": "scalenlp.config", "DataConfig": "scalenlp.config",
    "TokenizerConfig": "scalenlp.config", "TrainingConfig": "scalenlp.config", "CheckpointConfig": "scalenlp.config",
    "ParallelConfig": "scalenlp.config", "ConfigError": "scalenlp.config", "load_config": "scalenlp.train.tasks",
    "UserError": "scalenlp.errors",
    "Trainer": "scalenlp.train.trainer", "train": "scalenlp.train.trainer",
    "load": "scalenlp.loader", "read": "scalenlp.loader", "Pretrained": "scalenlp.models.pretrained",
    "Engine": "scalenlp.engine.decoder_engine", "SamplingParams": "scalenlp.engine.sampling", "LLM": "scalenlp.engine.llm",
    "EngineConfig": "scalenlp.engine.config", "EncoderEngineConfig": "scalenlp.engine.config",
    "encoder_from_checkpoint": "scalenlp.engine.encoder_engine",
    "ServeLimits": "scalenlp.serving.limits",
    "plan": "scalenlp.plan.planner", "Plan": "scalenlp.plan.planner",
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'scalenlp' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    # `train` and `plan` name both a function here and a subpackage; importing the subpackage (load_config comes
    # from scalenlp.train.tasks) binds the package over the function, so unbind it and the next lookup lands here.
    for shadowed in ("train", "plan"):
        if isinstance(globals().get(shadowed), types.ModuleType):
            del globals()[shadowed]
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
