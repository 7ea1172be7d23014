"""The encoder under tensor parallelism (two gloo processes) computes what one process does, with BERT's options
and with RoBERTa's and DistilBERT's (positions over non-pad tokens, own classifier dense layer, no token types)."""

import copy

import pytest
import torch

from scalenlp.models.encoder import Encoder, EncoderArgs
from scalenlp.testing.ranks import spawn_ranks

pytestmark = pytest.mark.slow  # spawns processes: ~12 s here with BERT alone, 40 s with the five cases on a loaded 2-core machine


LABELS = {"classification": ["negative", "positive"], "token_classification": ["O", "B-PER", "I-PER"],
          "question_answering": []}
ROBERTA = {"family": "roberta", "pad_token_id": 1, "position_offset": 2, "type_vocab_size": 1, "classifier_head": "tanh"}
DISTILBERT = {"family": "distilbert", "type_vocab_size": 0, "classifier_head": "relu", "pooler": False}
CASES = [("classification", {}), ("token_classification", {"pooler": False}), ("classification", ROBERTA),
         ("question_answering", ROBERTA), ("classification", DISTILBERT)]


def tiny(task: str, options: dict) -> Encoder:
    torch.manual_seed(0)
    return Encoder(EncoderArgs(vocab_size=96, dim=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=64, task=task,
                               labels=LABELS[task], **options)).eval()


def _tp_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from scalenlp.parallel.tensor_parallel import apply_tp

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    ids = torch.randint(0, 96, (3, 12), generator=torch.Generator().manual_seed(1))
    mask = (torch.arange(12) < torch.tensor([[12], [7], [3]])).long()  # right-padded, three lengths
    for task, options in CASES:
        reference = tiny(task, options)
        sharded = copy.deepcopy(reference)
        with pytest.raises(ValueError, match="sequence parallelism is not implemented for encoders"):
            apply_tp(sharded, mesh["tp"], sequence_parallel=True)
        apply_tp(sharded, mesh["tp"], sequence_parallel=False)
        for name in ("layers.0.attention.wq.weight", "layers.1.feed_forward.w2.weight", "tok_embeddings.weight"):
            local = sharded.get_parameter(name).to_local()
            assert local.numel() == reference.get_parameter(name).numel() // world, name
        with torch.no_grad():
            ours, theirs = sharded(ids, mask), reference(ids, mask)
            keep = mask.bool() if ours.dim() == 3 else slice(None)
            torch.testing.assert_close(ours[keep], theirs[keep], atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(sharded.embed(ids, mask), reference.embed(ids, mask), atol=1e-6, rtol=1e-5)


def test_tensor_parallel_encoder_matches_one_process():
    """Two gloo processes: column/row-parallel q/k/v/o and MLP, vocabulary-parallel embedding."""
    spawn_ranks(_tp_worker, 2)
