"""A model-zoo sweep: does SeaBiscuit take any architecture, as a user would try it?

Every architecture is built from a small seeded config (no download), traced, decomposed at
two budgets (a quarter of its largest op's working set, and 64 KiB), run with
``sb.run_local`` and compared with eager torch: fp32 within 1e-4 relative, and the model cast
to bfloat16 against eager bfloat16 within 3e-2 (bf16 keeps 8 bits of mantissa; the cut
changes the order of its sums). Each row is ``pass`` or the typed error that stopped it
(``SeaBiscuitError`` subclasses name the op and the model); an untyped exception or a wrong
answer is a bug and says so.

    python benchmarks/zoo.py [--only gpt2 bert ...] [--family decoder ...] [--dtypes fp32 bf16]
                             [--markdown docs/zoo.md]
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SEQ, VOCAB, IMAGE = 12, 512, 32

# NOTE: set where the config has the field; a field it lacks is left alone
SMALL: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, max_position_embeddings=128, n_embd=64, n_layer=2, n_head=4, n_positions=128,
    n_inner=128, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, d_ff=128, num_layers=2,
    num_decoder_layers=2, num_heads=4, d_kv=16, ffn_dim=128, head_dim=16, embedding_size=64,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2, type_vocab_size=2,
    image_size=IMAGE, patch_size=8, num_channels=3, tie_word_embeddings=True,
)


READ_ONLY = ("head_dim",)      # NOTE: derived from hidden_size and heads in some configs


@dataclass(frozen=True)
class Case:
    """One architecture: how to build it and what to call it with."""

    name: str
    family: str              # decoder, encoder, encoder-decoder, vision, detection, speech
    model_type: str
    auto: str = "AutoModel"
    inputs: str = "text"     # text, seq2seq, image, audio, features
    overrides: dict[str, Any] = field(default_factory=dict)
    keep: tuple[str, ...] = ()        # fields of SMALL this config keeps at its default

    def build(self, seed: int = 0) -> torch.nn.Module:
        import transformers as tf

        default = tf.AutoConfig.for_model(self.model_type)
        small = {k: v for k, v in SMALL.items() if hasattr(default, k) and k not in READ_ONLY + self.keep}
        cfg = tf.AutoConfig.for_model(self.model_type, **{**small, **self.overrides})
        torch.manual_seed(seed)
        cls = getattr(tf, self.auto)
        return (cls.from_config(cfg) if self.auto.startswith("Auto") else cls(cfg)).eval()

    def example(self, model: torch.nn.Module) -> tuple[tuple[Any, ...], dict[str, Any]]:
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(3, VOCAB, (1, SEQ), generator=g)
        if self.inputs == "text":
            return (ids,), {}
        if self.inputs == "seq2seq":
            return (ids,), {"decoder_input_ids": torch.randint(3, VOCAB, (1, SEQ // 2), generator=g)}
        if self.inputs == "image":
            return (torch.randn(1, 3, IMAGE, IMAGE, generator=g),), {}
        if self.inputs == "audio":
            return (torch.randn(1, 1600, generator=g),), {}
        if self.inputs == "features":          # log-mel frames (Whisper's encoder)
            cfg = model.config
            return (torch.randn(1, cfg.num_mel_bins, 2 * cfg.max_source_positions, generator=g),), {}
        raise ValueError(self.inputs)


# NOTE: experts as batched matmuls over every token (static shapes), not a loop over the tokens routed
MOE = {"experts_implementation": "batched_mm"}


def _decoders() -> list[Case]:
    d = "decoder"
    lm = "AutoModelForCausalLM"
    return [
        Case("gpt2", d, "gpt2", lm), Case("gpt_neo", d, "gpt_neo", lm, overrides={
            "num_layers": 2, "attention_types": [[["global", "local"], 1]], "window_size": 8}),
        Case("gptj", d, "gptj", lm, overrides={"rotary_dim": 8}),
        Case("gpt_neox", d, "gpt_neox", lm), Case("llama", d, "llama", lm), Case("mistral", d, "mistral", lm),
        Case("mixtral", d, "mixtral", lm, overrides={"num_local_experts": 4, "num_experts_per_tok": 2,
                                                    **MOE}),
        Case("qwen2", d, "qwen2", lm), Case("qwen3", d, "qwen3", lm),
        Case("qwen2_moe", d, "qwen2_moe", lm, overrides={"num_experts": 4, "num_experts_per_tok": 2,
                                                          "moe_intermediate_size": 32,
                                                          "shared_expert_intermediate_size": 64, **MOE}),
        Case("phi", d, "phi", lm), Case("phi3", d, "phi3", lm), Case("gemma", d, "gemma", lm),
        Case("gemma2", d, "gemma2", lm), Case("falcon", d, "falcon", lm), Case("bloom", d, "bloom", lm),
        Case("opt", d, "opt", lm, overrides={"word_embed_proj_dim": 64, "ffn_dim": 128}),
        Case("mpt", d, "mpt", lm, overrides={"d_model": 64, "n_heads": 4, "n_layers": 2,
                                            "expansion_ratio": 2}),
        Case("codegen", d, "codegen", lm, overrides={"rotary_dim": 8}),
        Case("starcoder2", d, "starcoder2", lm), Case("olmo", d, "olmo", lm), Case("olmo2", d, "olmo2", lm),
        Case("stablelm", d, "stablelm", lm), Case("granite", d, "granite", lm),
        Case("cohere", d, "cohere", lm),
        Case("persimmon", d, "persimmon", lm), Case("biogpt", d, "biogpt", lm), Case("xglm", d, "xglm", lm),
        Case("gpt_bigcode", d, "gpt_bigcode", lm), Case("smollm3", d, "smollm3", lm),
    ]


def _encoders() -> list[Case]:
    e = "encoder"
    return [Case(t, e, t) for t in (
        "bert", "roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2", "camembert",
        "xlm-roberta", "mpnet", "ernie", "roformer", "squeezebert", "mobilebert", "convbert", "nystromformer",
        "data2vec-text", "megatron-bert", "xlm")] + [
        Case("funnel", e, "funnel", overrides={"block_sizes": [1, 1], "num_decoder_layers": 1},
             keep=("num_hidden_layers",))]


def _encoder_decoders() -> list[Case]:
    s = "encoder-decoder"
    return [Case(t, s, t, inputs="seq2seq") for t in (
        "t5", "mt5", "bart", "mbart", "pegasus", "marian", "blenderbot", "m2m_100", "plbart")]


def _vision() -> list[Case]:
    v = "vision"
    pyramid = {"hidden_sizes": [16, 32], "depths": [1, 1], "embed_dim": 16}
    return [
        Case("vit", v, "vit", inputs="image"), Case("deit", v, "deit", inputs="image"),
        Case("beit", v, "beit", inputs="image"), Case("dinov2", v, "dinov2", inputs="image"),
        Case("convnext", v, "convnext", inputs="image", overrides=pyramid),
        Case("resnet", v, "resnet", inputs="image", overrides={**pyramid, "embedding_size": 16}),
        Case("regnet", v, "regnet", inputs="image", overrides={**pyramid, "embedding_size": 16}),
        Case("swin", v, "swin", inputs="image",
             overrides={"embed_dim": 16, "depths": [1, 1], "num_heads": [2, 2], "window_size": 2,
                        "patch_size": 4},
             keep=("num_attention_heads", "num_hidden_layers", "hidden_size")),
        Case("poolformer", v, "poolformer", inputs="image",
             overrides={"hidden_sizes": [16, 32], "depths": [1, 1], "num_encoder_blocks": 2}),
        Case("mobilenet_v2", v, "mobilenet_v2", inputs="image"),
        Case("levit", v, "levit", inputs="image", overrides={
            "image_size": 64, "hidden_sizes": [32, 64, 96], "num_attention_heads": [2, 4, 6],
            "depths": [1, 1, 1], "key_dim": [8, 8, 8]}, keep=("patch_size",)),
    ]


def _detection() -> list[Case]:
    """Detection models: their backbones (a ResNet, a ViT) with the heads' encoders and queries.
    (torchvision's own cannot run here: no CPU build of it for this torch is installable.)"""
    det = "detection"
    resnet = {"model_type": "resnet", "hidden_sizes": [16, 32], "depths": [1, 1], "embedding_size": 16,
              "out_features": ["stage2"]}
    return [
        Case("detr", det, "detr", inputs="image", keep=("num_channels",), overrides={
            "use_timm_backbone": False, "use_pretrained_backbone": False, "backbone_config": resnet,
            "num_queries": 8, "encoder_layers": 1, "decoder_layers": 1}),
        Case("yolos", det, "yolos", inputs="image", overrides={"num_detection_tokens": 4,
                                                              "image_size": [IMAGE, IMAGE]}),
        Case("rt_detr", det, "rt_detr", inputs="image", overrides={"num_queries": 8}),
    ]


def _speech() -> list[Case]:
    sp = "speech"
    conv = {"conv_dim": [16, 16], "conv_stride": [5, 2], "conv_kernel": [10, 3],
            "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 4}
    return [
        Case("wav2vec2", sp, "wav2vec2", inputs="audio", overrides=conv),
        Case("hubert", sp, "hubert", inputs="audio", overrides=conv),
        Case("wavlm", sp, "wavlm", inputs="audio", overrides=conv),
        Case("whisper-encoder", sp, "whisper", "WhisperForAudioClassification", inputs="features",
             overrides={"num_mel_bins": 16, "max_source_positions": 16, "encoder_layers": 2}),
    ]


ZOO = _decoders() + _encoders() + _encoder_decoders() + _vision() + _detection() + _speech()
BF16_TOL = 3e-2


def largest_working_set(graph: Any) -> int:
    return max(graph.working_set(op) for op in graph.ops)


def check(case: Case, dtype: torch.dtype,
          budgets: Callable[[Any], list[int]] | None = None) -> dict[str, Any]:
    """Trace, decompose at each budget, run and compare ``case``; a row of the sweep's table."""
    import seabiscuit_dask as sb
    from seabiscuit_dask.errors import SeaBiscuitError

    row: dict[str, Any] = {"name": case.name, "family": case.family,
                           "dtype": str(dtype).removeprefix("torch."), "result": "pass", "detail": ""}
    t0 = time.perf_counter()
    try:
        model = case.build().to(dtype)
        args, kwargs = case.example(model)
        args = tuple(a.to(dtype) if a.is_floating_point() else a for a in args)
        with torch.no_grad():
            expected = first(model(*args, **kwargs)).float()
    except Exception as e:  # noqa: BLE001 - the architecture itself did not build here
        row.update(result="not built", detail=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
        return row
    try:
        graph = sb.trace(model, args, kwargs)
        cut = (budgets or default_budgets)(graph)
        row["ops"], row["budgets"] = len(graph.ops), cut
        worst = 0.0
        for budget in cut:
            micro = sb.decompose(graph, budget)
            got = first(sb.run_local(micro, *args, weights=model, **kwargs)).float()
            if got.shape != expected.shape:
                raise AssertionError(f"shape {tuple(got.shape)} against {tuple(expected.shape)}")
            worst = max(worst, rel_err(got, expected))
            row["micro_ops"] = len(micro.ops)
        row["rel_err"] = worst
        if worst > (1e-4 if dtype == torch.float32 else BF16_TOL):
            row.update(result="WRONG", detail=f"relative error {worst:.2e}")
    except SeaBiscuitError as e:
        row.update(result=type(e).__name__, detail=str(e).splitlines()[0][:240])
    except Exception as e:  # noqa: BLE001 - an untyped failure: a bug to fix
        where = traceback.extract_tb(e.__traceback__)[-1]
        row.update(result="UNTYPED", detail=f"{type(e).__name__}: {str(e).splitlines()[0][:160]} "
                                            f"({Path(where.filename).name}:{where.lineno})" if str(e) else
                   f"{type(e).__name__} ({Path(where.filename).name}:{where.lineno})")
    row["seconds"] = time.perf_counter() - t0
    return row


def default_budgets(graph: Any) -> list[int]:
    return sorted({largest_working_set(graph) // 4, 64 * 1024}, reverse=True)


def first(out: Any) -> torch.Tensor:
    """The main tensor of a model output (logits / last hidden state / a tensor)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        return next(v for v in out.values() if isinstance(v, torch.Tensor))
    return out[0]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


HEADER = """# The model zoo

Each architecture is built from a small seeded config, traced, cut at a quarter of its
largest op's working set and at 64 KiB, run with `sb.run_local` and compared with eager
torch (fp32: 1e-4 relative; bf16 against eager bf16: 3e-2). `not built` rows are configs
this sweep could not make small, not SeaBiscuit failures, and are left out of the counts.
Made by `python benchmarks/zoo.py --markdown docs/zoo.md`; `tests/test_zoo.py` runs a fast
subset. Classification and detection backbones are Hugging Face's (ResNet, RegNet, ConvNeXt,
MobileNetV2, Swin, ViT; DETR's ResNet, YOLOS's ViT): torchvision itself has no CPU build for
this torch among the packages this machine can install (PyPI's is a CUDA build whose ops do
not load beside the CPU torch).
"""


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| architecture | family | dtype | result | ops | micro-ops (64 KiB) | rel. error | detail |",
             "|---|---|---|---|---:|---:|---:|---|"]
    for r in rows:
        err = f"{r['rel_err']:.1e}" if "rel_err" in r else ""
        lines.append(f"| {r['name']} | {r['family']} | {r['dtype']} | {r['result']} | {r.get('ops', '')} | "
                     f"{r.get('micro_ops', '')} | {err} | {r['detail'].replace('|', '/')} |")
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> str:
    out = []
    for dtype in sorted({r["dtype"] for r in rows}):
        mine = [r for r in rows if r["dtype"] == dtype and r["result"] != "not built"]
        by_family = Counter(r["family"] for r in mine)
        passed = Counter(r["family"] for r in mine if r["result"] == "pass")
        fams = ", ".join(f"{f} {passed[f]}/{n}" for f, n in sorted(by_family.items()))
        total = sum(passed.values())
        share = 100 * total / max(1, len(mine))
        out.append(f"{dtype}: {total}/{len(mine)} equivalent ({share:.0f}%): {fams}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--family", nargs="*", default=None)
    ap.add_argument("--dtypes", nargs="*", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--markdown", type=Path, default=None, help="write the table here too")
    args = ap.parse_args()
    cases = [c for c in ZOO if (not args.only or c.name in args.only)
             and (not args.family or c.family in args.family)]
    rows = []
    for dtype in [{"fp32": torch.float32, "bf16": torch.bfloat16}[d] for d in args.dtypes]:
        for case in cases:
            row = check(case, dtype)
            rows.append(row)
            print(f"{row['name']:<18} {row['dtype']:<9} {row['result']:<14} {row.get('seconds', 0):6.1f}s  "
                  f"{row['detail'][:150]}", flush=True)
    print()
    print(summary(rows))
    if args.markdown:
        args.markdown.write_text(f"{HEADER}\n{summary(rows)}\n\n{table(rows)}\n")


if __name__ == "__main__":
    main()
