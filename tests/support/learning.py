"""A tiny randomly initialised causal LM and a byte-level tokenizer, built locally (no downloads)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Return a byte-level tokenizer with no merges: one token per byte, plus <pad>."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["<pad>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>")


def tiny_model(vocab: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> GPT2LMHeadModel:
    """Return a 1-layer GPT-2 with random weights."""
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab, n_positions=512, n_embd=32, n_layer=1, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return GPT2LMHeadModel(cfg).to(dtype)


def tiny_model_dir(folder: Path) -> Path:
    """Save the tiny model (float32) and its tokenizer in `folder` and return it."""
    tok = tiny_tokenizer()
    tiny_model(len(tok), dtype=torch.float32).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def records() -> list[dict[str, Any]]:
    """Return distillation records shaped like `grove export-trajectories` output."""
    return [
        {
            "prompt": [{"role": "system", "content": "fix it"}, {"role": "user", "content": "set x"}],
            "rollout": [{"role": "assistant", "content": "x = 1"}],
            "feedback": "dev score fell: x should be 3",
        },
        {"prompt": "add two and two:", "rollout": " 5", "feedback": "wrong: the answer is 4"},
    ]
