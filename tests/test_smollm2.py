"""SmolLM2-135M-Instruct with its real weights (GGUF, de-quantised): the README's main job.

The model is loaded once for the module (about 20 s); every answer is checked
token for token against Hugging Face ``generate`` on the same model.
"""

from __future__ import annotations

import re

import pytest
import torch

import seabiscuit_dask as sb
from seabiscuit_dask import cli
from seabiscuit_dask.demo import prompt_ids
from seabiscuit_dask.models import load_gguf

from .clusters import seabiscuit_cluster

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::ResourceWarning")]

NEW = 12


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("gguf")
    return load_gguf()


def hf(model, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids) if mask is None else mask,
                              max_new_tokens=NEW, do_sample=False)


def test_chat_answers_match_hugging_face_on_workers_that_cannot_hold_the_model(smollm2) -> None:
    model, tok = smollm2
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    short = prompt_ids(tok, "What is the capital of France?", chat=True)
    long = prompt_ids(tok, "Name three rivers of Europe and the seas they flow into, in one sentence each.",
                      chat=True)
    assert short.shape[1] != long.shape[1]
    with seabiscuit_cluster(2, 420_000_000) as client:
        with sb.distribute(model, client, torch.zeros(1, 64, dtype=torch.long), sessions=2,
                           context=256) as dm:
            assert all(d.memory_bytes < weights for d in dm.plan.spec.devices)
            answer = dm.generate(short, NEW)
            assert torch.equal(answer, hf(model, short))
            assert "Paris" in tok.decode(answer[0, short.shape[1]:])
            assert torch.equal(dm.generate(long, NEW), hf(model, long))
            tok.padding_side = "left"
            batch = tok([tok.decode(short[0]), tok.decode(long[0])], return_tensors="pt", padding=True,
                        add_special_tokens=False)
            got = dm.generate(batch["input_ids"], NEW, attention_mask=batch["attention_mask"])
            assert torch.equal(got, hf(model, batch["input_ids"], batch["attention_mask"]))
            stats = dm.generation_stats()
            # one deployment, two step programs: decode at any batch, prefill at any rows and length
            assert set(stats["programs"]) == {"decode", "prefill"}
            assert stats["programs"]["decode"]["tasks"] <= len(dm.specs)
            held = client.run(lambda dask_worker: dask_worker.plugins["seabiscuit"].metrics())
            assert all(r["resident_bytes"] <= r["budget_bytes"] and r["kv_cache_bytes"] == 0
                       for r in held.values())


def seeded_folder(tok, path) -> None:
    """A seeded Llama with SmolLM2's tokenizer, saved as a Hugging Face folder."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    tf.LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)


def test_generate_command_streams_a_checked_answer(smollm2, tmp_path, capsys) -> None:
    """``seabiscuit generate --model FOLDER``: a seeded Llama with SmolLM2's tokenizer, saved as a folder."""
    seeded_folder(smollm2[1], tmp_path)
    code = cli.main(["generate", "--model", str(tmp_path), "--prompt", "Hello there", "--chat",
                     "--workers", "2", "--max-new-tokens", "6", "--budget", "4MiB"])
    captured = capsys.readouterr()
    out = captured.out
    assert code == 0, out + captured.err
    assert "check        OK: the same tokens as Hugging Face generate" in out
    assert "blocks per token (a decode loop on the workers)" in out and "smaller than the model" in out
    assert "dashboard    http" in out


def test_generate_command_quantized_reads_int8_tiles_from_the_folders_safetensors(smollm2, tmp_path,
                                                                                  capsys) -> None:
    """``--quantize int8`` on a folder: the workers read its float rows from the safetensors file and
    keep int8 tiles; the answer is set against the float model's, token by token."""
    seeded_folder(smollm2[1], tmp_path)
    code = cli.main(["generate", "--model", str(tmp_path), "--prompt", "Hello there", "--chat",
                     "--workers", "2", "--max-new-tokens", "6", "--budget", "4MiB", "--quantize", "int8"])
    captured = capsys.readouterr()
    out = captured.out
    assert code == 0, out + captured.err
    same = re.search(r"check        int8 weights: the first (\d+) of 6 tokens the same as", out)
    assert same is not None and int(same.group(1)) >= 1, out
    with pytest.raises(SystemExit):                                   # NOTE: argparse: not a scheme here
        cli.main(["generate", "--quantize", "int3"])
    assert "invalid choice: 'int3'" in capsys.readouterr().err


def test_generate_keeps_the_gguf_quantized_reading_it_in_place(smollm2, capsys) -> None:
    """``generate`` on the GGUF, asked nothing: the file's Q4_1 blocks are the workers' tiles (no float
    copy of them; what ``--quantize int4`` also does), and the answer is set against the float
    model's. ``--dequantize`` (float32) and ``--quantize`` are one choice or the other."""
    code = cli.main(["generate", "--prompt", "What is the capital of France?", "--chat", "--workers", "2",
                     "--max-new-tokens", "6"])
    captured = capsys.readouterr()
    out = captured.out
    assert code == 0, out + captured.err
    assert "in place (int4" in out and "kept quantized as the file is" in out and "of them int4" in out, out
    assert "Q8_0 (1 tensor) de-quantized and held as int4 (linear) or int8 per row" in out, out
    same = re.search(r"check        int4 weights: the first (\d+) of \d+ tokens the same as", out)
    assert same is not None and int(same.group(1)) >= 1, out
    with pytest.raises(SystemExit):
        cli.main(["generate", "--quantize", "int4", "--dequantize"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_demo_is_smollm2_answering_a_chat_prompt(capsys) -> None:
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct" in out and "Paris" in out
    assert "check        OK" in out and "smaller than the model" in out
