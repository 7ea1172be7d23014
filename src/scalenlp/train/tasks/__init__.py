"""Training tasks, by the name ``training.task`` gives them; the only place that name is looked at.

A task is one module here with one ``Task`` subclass (base.py states the interface; its defaults are a decoder
learning the next token), registered in ``TASKS``. It provides:

- ``validate(cfg)``: its config rules; ``check_checkpoint``: the kind of model model.init must be;
- ``build_data``: this rank's loader (and, kept for later, the eval data and the tokenizer the export copies);
  ``rows`` and ``dataset``: what data preparation caches and what reads it, where it uses the token cache;
- ``build_model``: the model args and the model with its head;
- ``micro_batch_loss``: the summed loss of one micro-batch (``counted_targets``: what the trainer averages by);
- ``evaluate`` and ``describe``: the scores of an evaluation (metrics.jsonl) and their log line;
  ``best_scores``: those checkpoint.keep_best may keep the best checkpoint by;
- ``record`` and ``progress``: what a metrics record and its log line add; ``model_class``: what the export holds.

A new task is one more module: a Task subclass overriding these, and its line in ``TASKS`` (qa.py and
token_classification.py were added so).
"""

from __future__ import annotations

from pathlib import Path

from scalenlp import config
from scalenlp.config import Config, check_choice
from scalenlp.train.tasks.base import Task
from scalenlp.train.tasks.classification import Classification
from scalenlp.train.tasks.lm import LanguageModeling
from scalenlp.train.tasks.qa import QuestionAnswering
from scalenlp.train.tasks.sft import ChatFineTuning
from scalenlp.train.tasks.token_classification import TokenClassification

TASKS: dict[str, type[Task]] = {"lm": LanguageModeling, "sft": ChatFineTuning, "classification": Classification,
                                "token_classification": TokenClassification, "qa": QuestionAnswering}


def get_task(name: str) -> Task:
    """A new Task of the kind ``name`` (training.task) names; one serves one run."""
    check_choice(name, tuple(TASKS), "training.task")
    return TASKS[name]()


def task_for(cfg: Config) -> Task:
    """training.task's Task, once its config rules hold for ``cfg``."""
    task = get_task(cfg.training.task)
    task.validate(cfg)
    return task


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """A training config validated exactly as `scalenlp train` validates it: ``config.load_config`` (defaults, TOML,
    overrides, the rules of every section), then training.task's own rules, which config.py (below the tasks)
    cannot reach. ``scalenlp.load_config`` is this."""
    cfg = config.load_config(path, overrides)
    task_for(cfg)
    return cfg
