"""plait's model equals transformers' on the same weights: every position, cached prefixes,
decode."""

from __future__ import annotations

import pytest
import torch

from plait.runtime.batch import ExtendEntry, ScheduleBatch
from plait.runtime.kv_pool import KVPool
from plait.runtime.model_loader import load_model
from plait.runtime.model_runner import ModelRunner
from plait.runtime.protocol import SamplingParams
from plait.runtime.request import Request, SamplingState
from tests.conftest import write_tiny_checkpoint

TOL = 1e-4


def make_runner(path: str, page_size: int) -> tuple[ModelRunner, object]:
    loaded = load_model(path, torch.float32, torch.device("cpu"))
    args = loaded.args
    pool = KVPool(
        256,
        page_size,
        args.num_layers,
        args.num_kv_heads,
        args.head_dim,
        torch.float32,
        torch.device("cpu"),
    )
    runner = ModelRunner(loaded.model, pool, torch.device("cpu"), frozenset([2]), torch.Generator())
    return runner, loaded


def all_logits(runner: ModelRunner, batch: ScheduleBatch) -> torch.Tensor:
    prepared = runner.prepare(batch)
    prepared.forward_batch.logits_indices = None
    with torch.inference_mode():
        return runner.model(prepared.input_ids, prepared.positions, prepared.forward_batch)


def request(ids: list[int], first_page: int, page_size: int) -> Request:
    req = Request(
        rid=f"r{first_page}",
        prompt_ids=ids,
        sampling=SamplingState(SamplingParams(max_new_tokens=1)),
    )
    num_pages = -(-len(ids) // page_size)
    # deliberately non-contiguous pages, in reverse order
    req.kv.pages = [first_page + 2 * i for i in range(num_pages)][::-1]
    return req


def hf_logits(path, ids: list[int]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


CASES = {
    "llama": {},
    "llama-rope3": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
    "llama-tied": {"tie_word_embeddings": True},
    "qwen2": {},
    "mistral": {"sliding_window": 16},
}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory, smollm_tokenizer):
    name = request.param
    arch = name.split("-")[0]
    path = tmp_path_factory.mktemp(name)
    write_tiny_checkpoint(path, arch, smollm_tokenizer, seed=len(name), **CASES[name])
    return str(path)


@pytest.mark.parametrize("page_size", [1, 4])
def test_every_position_matches_transformers(checkpoint, page_size):
    runner, _ = make_runner(checkpoint, page_size)
    ids = torch.randint(3, 49152, (45,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = hf_logits(checkpoint, ids)
    req = request(ids, 0, page_size)
    ours = all_logits(runner, ScheduleBatch(extends=[ExtendEntry(req, 0, len(ids), True)]))
    assert (ours - ref).abs().max().item() < TOL

    # the same prompt as a cached prefix plus an extension, then one decode step
    req2 = request(ids, 1, page_size)
    all_logits(runner, ScheduleBatch(extends=[ExtendEntry(req2, 0, 20, False)]))
    ext = all_logits(runner, ScheduleBatch(extends=[ExtendEntry(req2, 20, 44, False)]))
    assert (ext - ref[20:44]).abs().max().item() < TOL
    dec = all_logits(runner, ScheduleBatch(decodes=[req2]))
    assert (dec[0] - ref[44]).abs().max().item() < TOL


def test_ragged_mixed_batch_matches_transformers(checkpoint):
    runner, _ = make_runner(checkpoint, 2)
    gen = torch.Generator().manual_seed(2)
    a = torch.randint(3, 49152, (30,), generator=gen).tolist()
    b = torch.randint(3, 49152, (17,), generator=gen).tolist()
    c = torch.randint(3, 49152, (9,), generator=gen).tolist()
    ref_a, ref_b, ref_c = (hf_logits(checkpoint, x) for x in (a, b, c))
    ra, rb, rc = request(a, 0, 2), request(b, 1, 2), request(c, 60, 2)
    all_logits(runner, ScheduleBatch(extends=[ExtendEntry(rb, 0, 16, False)]))
    all_logits(runner, ScheduleBatch(extends=[ExtendEntry(rc, 0, 4, False)]))
    # one forward: a fresh prompt, an extension of a cached prefix, and a decode token
    out = all_logits(
        runner,
        ScheduleBatch(
            extends=[ExtendEntry(ra, 0, 30, True), ExtendEntry(rc, 4, 9, True)], decodes=[rb]
        ),
    )
    assert (out[:30] - ref_a).abs().max().item() < TOL
    assert (out[30:35] - ref_c[4:9]).abs().max().item() < TOL
    assert (out[35] - ref_b[16]).abs().max().item() < TOL


def test_missing_model_path_names_what_was_looked_for(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "nope"), torch.float32, torch.device("cpu"))
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="unsupported architecture.*LlamaForCausalLM"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"))
