"""Fixtures every tier shares, and the fast tier's budget.

Tiers: ``tests/unit`` runs in this process (no subprocess, server or process group); ``tests/integration``
runs commands, several processes and servers as a user does. ``-m "not slow"`` is the fast loop;
``--max-test-seconds S`` (``make test-fast``) fails any test not marked slow whose call takes longer than S,
so the fast loop keeps its budget as tests are added.
"""

from __future__ import annotations

import os
import sys

import pytest
from torch.utils import cpp_extension

from infer_helpers import make_export, make_hf_chat_model
from train_helpers import SHARED_DATA, make_hf_llama, write_chats, write_corpus

# `--compile auto` (the engine's default) compiles the decode step where it measured faster, a minute of start-up
# here: the servers and engines the tests start run eagerly (this process's and every subprocess's environment).
# The tests of compiling ask for it, and test_compile_choice tests the auto decision with the timing injected.
os.environ.setdefault("SCALENLP_COMPILE", "off")
# lora.pack_frozen=auto times the frozen products once per machine and shape: two runs of a test (an interrupted one
# and its resume) could read different decisions, written by workers racing on the same figure. The LoRA runs hold
# in the layout training.compile takes too; test_frozen_packing tests the decision with the timing injected.
os.environ.setdefault("SCALENLP_PACK_FROZEN", "transposed")
# scalenlp's C++ kernels are built into torch's extension folder, which follows $XDG_CACHE_HOME. Tests that point
# that at a temporary folder, to keep their measured figures apart, rebuilt there the first kernel they reached
# (12-17 s): the folder stays where pytest_configure builds them, for this process, xdist's workers and subprocesses.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", cpp_extension.get_default_build_root())


def pytest_addoption(parser):
    parser.addoption("--max-test-seconds", type=float, default=None,
                     help="fail a test not marked slow whose call phase takes longer than this")


def pytest_configure(config):
    """Build (or load the cached builds of) scalenlp's C++ kernels once, before any test and before pytest-xdist
    starts its workers: on a fresh machine a build takes 20-40 s, which the first test to attend would pay (two
    workers at once, one waiting on the other's build lock) and the fast tier's --max-test-seconds would fail."""
    if hasattr(config, "workerinput"):  # an xdist worker: the controller has built them
        return
    from scalenlp.compress import quantized
    from scalenlp.engine import lora, packing
    from scalenlp.models import cpu_attention, paged_attention

    cpu_attention.available()
    paged_attention.available()
    lora.kernel_available()
    quantized.lowbit_kernels_available()
    packing.native_lookup()
    packing.panel_kernel()


# The files whose tests took longest in the last timed run (seconds of call phase, summed over their tests; CI's
# 25.7 min run of 2026-12-05, two workers), longest first, less what was cut from them since, as estimated from
# the same cut measured alone ("~"); "+" where tests under 21 s were not listed. pytest-xdist's ``--dist loadfile``
# hands files to its two workers in collection order (the Makefile turns off its own reordering, by test count,
# which put the one-test 150 s file near the end), so these start early and the last minutes do not leave one
# worker running a long file alone.
LONGEST_FILES = (
    "test_sft_teaches_smollm2_a_fact.py",  # ~100 at 8 steps (138 at 12)
    "test_parallel_parity.py",  # ~135+ (163+ at 5 steps, the TP layouts rerun unstacked)
    "test_checkpoint_resharding.py",  # 129 (216 with the pp2 -> single and zero1x2 -> pp2 pairs)
    "test_ray_join.py",  # 109
    "test_multinode.py",  # ~99+ (106+ with its references in new processes)
    "test_qa_training.py",  # 95+
    "test_fault_recovery.py",  # 80+
    "test_schedulers.py",  # ~76+ with its fixture's 24 (98+ while Slurm's scheduler passed every 60 s)
    "test_tied_pipeline.py",  # 72+
    "test_ray_serve.py",  # 71+ with its fixture's 31
    "test_ray_autoscale.py",  # 71
    "test_classification_training.py",  # 64+ (and 3 two-process layouts, 5 before)
    "test_fp16_training.py",  # 58+
    "test_fine_tuning_layouts.py",  # 44 (86 with test_layouts_start_from_the_same_weights)
)


def pytest_collection_modifyitems(items):
    """Collect ``LONGEST_FILES`` first, in that order; the rest keep their order after them."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    limit = item.config.getoption("--max-test-seconds")
    if (limit is not None and report.when == "call" and report.passed and report.duration > limit
            and item.get_closest_marker("slow") is None):
        report.outcome = "failed"
        report.longrepr = (f"took {report.duration:.1f} s, over the fast tier's {limit:g} s: make it cheaper or "
                           f"mark it @pytest.mark.slow")


def pytest_runtest_teardown(item):
    """Empty FastAPI's caches of endpoint functions after each test. They keep (up to 4,096 of) the endpoints of
    every app made in the process, and so each app's backend, its engine, model and KV cache: harmless in a
    server, which makes one app, but across this suite's hundreds of apps it grew pytest to 24 GiB and the
    kernel killed it."""
    models = sys.modules.get("fastapi.dependencies.models")
    for obj in vars(models).values() if models else ():
        if hasattr(obj, "cache_clear"):
            obj.cache_clear()


@pytest.fixture(scope="session")
def shared_data():
    """../shared/data (see its README); tests that need a set in it skip, naming it, when it is absent."""
    return SHARED_DATA


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A text file of ~60k characters (Tiny Shakespeare where ../shared/data has it, else generated words)."""
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


@pytest.fixture(scope="session")
def hf_llama(tmp_path_factory, corpus, transformers):
    """A random Llama (GQA, tied embeddings) saved by transformers with a BPE of the corpus and a ChatML template
    whose end of turn is its end of text (train_helpers.make_hf_llama), the model.init of the fine-tuning tests,
    built once per session: read it, never write into it."""
    return make_hf_llama(tmp_path_factory.mktemp("hf_llama"), corpus)


@pytest.fixture(scope="session")
def chats(tmp_path_factory):
    """Chat-format training data (train_helpers.write_chats: 43 conversations, 3 unusable lines)."""
    return write_chats(tmp_path_factory.mktemp("chats") / "chats.jsonl")


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory):
    """A debug decoder exported with its own byte-level BPE tokenizer, built once per session: read it, never
    write into it (tests that change a model make their own with ``make_export``)."""
    return make_export(tmp_path_factory.mktemp("tiny_export"))


@pytest.fixture(scope="session")
def hf_chat_model(tmp_path_factory, transformers):
    """A tiny random Llama saved as a Hugging Face folder with a ChatML template whose end of turn is not its end
    of text (infer_helpers.make_hf_chat_model), built once per session: read it, never write into it."""
    return make_hf_chat_model(tmp_path_factory.mktemp("hf_chat"))


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct read from the GGUF the `models` extra installs (a Pretrained: arguments, tokenizer,
    tensors; no model built), once per session since reading it takes 5-35 s here: read it, never change it."""
    from scalenlp.loader import read
    from scalenlp.models.packaged import packaged_model

    return read(packaged_model("smollm2"))


@pytest.fixture(scope="session")
def transformers():
    """The transformers package with its Llama, GPT-2 and BERT models imported: 5-7 s here, ~40 s with a cold disk
    cache, paid once before the first test that compares with it rather than inside that test's own time."""
    import transformers

    for name in ("LlamaForCausalLM", "GPT2LMHeadModel", "BertModel"):
        getattr(transformers, name)  # the package imports its model modules on first use
    return transformers
