"""The loss registry (grpo/losses.py): a new loss is one function and one registration, made here from
the test file without touching a library file, then trained on through the public objective API;
a loss without a fused kernel runs its torch definition where the kernels run Triton (forced here
through the interpreter); config names, presets and docs/objectives.md come from the registry."""
import math
import warnings
from pathlib import Path

import pytest
import torch

import kernels
from grpo import losses, registry
from grpo.advantages import group_advantages
from grpo.config import ConfigError, load_config, read_yaml, to_dict
from grpo.kernel_dispatch import (_check_kernel_codes, check_objective_path, objective_fn_for, objective_of_hidden,
                                  objective_path, objective_with_grad)
from grpo.losses import CORRECTIONS, LOSSES, Knob, LossInputs, PolicyTerms, register_loss
from grpo.objective import ObjectiveConfig, finalize_stats, local_denominators, objective, token_weights
from grpo.registry import non_negative
from grpo.train_config import TrainConfig
from kernels import KernelConfig

ROOT = Path(__file__).resolve().parent.parent
D = torch.float64
L = math.log
TRITON = KernelConfig(backend="triton", loss_block=32, rows_per_program=8, block_v=64, chunk_tokens=4)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter on padding lanes


def close(actual, expected, tol=1e-12):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=D), torch.as_tensor(expected, dtype=D),
                               rtol=tol, atol=tol)


@pytest.fixture
def toy_losses():
    """Two losses a researcher could add: one per token, one per sequence (registered for the test only)."""

    @register_loss("toy_sign", equation="-sign(A) log pi", paper="(a test)", clips=False)
    def toy_sign(x: LossInputs, cfg) -> PolicyTerms:
        zero = torch.zeros_like(x.w)
        return PolicyTerms(-torch.sign(x.adv) * x.logp, torch.exp(x.logp.detach() - x.logp_k), zero, zero)

    @register_loss("toy_seq_mean", per="sequence", equation="-A mean_t log pi over the sequence", paper="(a test)",
                   clips=False)
    def toy_seq_mean(x: LossInputs, cfg) -> PolicyTerms:
        zero = torch.zeros_like(x.w)
        per_seq = x.seqs.sum(x.logp) / x.seqs.length.clamp(min=1)  # the per-sequence log-prob sums and lengths
        return PolicyTerms(-x.adv * x.seqs.per_token(per_seq), torch.ones_like(x.w), zero, zero)

    yield
    del LOSSES["toy_sign"], LOSSES["toy_seq_mean"]


def test_a_loss_registered_in_a_test_trains_through_the_public_api(toy_losses):
    cfg = ObjectiveConfig(loss="toy_sign", advantage="none", aggregation="token_mean")
    adv, seq_weight, _ = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=D), 4, cfg)  # 3/4, -1/4 x 3
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [0, 0]], dtype=torch.bool)
    num_seqs, num_tokens = local_denominators(mask, seq_weight, cfg)
    w = token_weights(mask, seq_weight, cfg, num_seqs=num_seqs, num_tokens=num_tokens, max_len=2)
    logp = torch.tensor([[L(0.5), L(0.25)], [L(0.1), 0.0], [L(0.2), L(0.4)], [0.0, 0.0]], dtype=D, requires_grad=True)
    loss, stats = objective(logp, logp.detach(), None, None, adv, w, cfg)
    loss.backward()
    # token mean over 5 tokens of -sign(A) log pi: sequence 0 has A > 0, the others A < 0
    close(loss, (-(L(0.5) + L(0.25)) + L(0.1) + L(0.2) + L(0.4)) / 5)
    close(logp.grad, [[-1 / 5, -1 / 5], [1 / 5, 0.0], [1 / 5, 1 / 5], [0.0, 0.0]])
    assert finalize_stats(stats)["num_tokens"] == 5


def test_a_sequence_loss_registered_in_a_test_gets_whole_sequences(toy_losses):
    cfg = ObjectiveConfig(loss="toy_seq_mean")
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    w = token_weights(mask, torch.ones(2, dtype=D), cfg, num_seqs=2, num_tokens=5, max_len=3)  # 1 / (2 L_b)
    logp = torch.tensor([[L(0.5), L(0.25), 9.0], [L(0.1), L(0.2), L(0.4)]], dtype=D, requires_grad=True)
    loss, stats = objective(logp, logp.detach(), None, None, torch.tensor([1.0, -2.0], dtype=D), w, cfg)
    loss.backward()
    # each token carries -A * (mean of its sequence's log pi); seq_mean gives each sequence 1/2 in all
    close(loss, (-(L(0.5) + L(0.25)) / 2 + 2 * (L(0.1) + L(0.2) + L(0.4)) / 3) / 2)
    close(logp.grad, [[-1 / 4, -1 / 4, 0.0], [2 / 6, 2 / 6, 2 / 6]])
    assert float(stats["num_seqs"]) == 2
    assert objective_path(cfg, torch.device("cpu"), KernelConfig()) == "sequence"


def test_a_loss_without_a_kernel_runs_its_torch_definition_where_triton_runs(toy_losses):
    # The CUDA dispatch, forced on CPU through the interpreter (TRITON): no KeyError, one warning, and
    # the fused LM head (Triton log-prob kernels) runs the loss's torch definition.
    cpu = torch.device("cpu")
    cfg = ObjectiveConfig(loss="toy_sign")
    assert objective_fn_for(cpu, TRITON, ObjectiveConfig()) is kernels.triton_objective  # grpo has a kernel
    with pytest.warns(UserWarning, match="loss 'toy_sign' has no fused kernel"):
        assert objective_fn_for(cpu, TRITON, cfg) is objective_with_grad
    with warnings.catch_warnings():  # once: the warning is not repeated every micro-batch
        warnings.simplefilter("error", UserWarning)
        assert objective_fn_for(cpu, TRITON, cfg) is objective_with_grad
        assert check_objective_path(cfg, cpu, TRITON) == "torch"
    with pytest.raises(ValueError, match="loss 'toy_sign' has no fused kernel"):
        kernels.grpo_objective(torch.zeros(3), torch.zeros(3), None, None, torch.ones(3), torch.ones(3), cfg,
                               config=TRITON)

    torch.manual_seed(1)
    n, hidden_size, vocab = 11, 8, 40
    hidden = torch.randn(n, hidden_size, requires_grad=True)
    weight = (torch.randn(vocab, hidden_size) / 3).requires_grad_()
    targets = torch.randint(0, vocab, (n,))
    adv, weights, zeros = torch.randn(n), torch.rand(n), torch.zeros(n)
    loss, stats, logp, _ = objective_of_hidden(hidden, weight, targets, zeros, None, None, adv, weights, cfg,
                                               seq_index=torch.arange(n) // 4, temperature=1.0, with_entropy=False,
                                               kernel_config=TRITON)
    grads = torch.autograd.grad(loss, (hidden, weight))
    plain = torch.log_softmax(hidden @ weight.t(), dim=-1).gather(1, targets[:, None])[:, 0]
    want_loss, want_stats = objective(plain, zeros, None, None, adv, weights, cfg)
    want = torch.autograd.grad(want_loss, (hidden, weight))
    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=1e-5)
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    for key in want_stats:
        torch.testing.assert_close(stats[key], want_stats[key], atol=1e-5, rtol=1e-5, msg=key)


def test_config_names_and_knobs_come_from_the_registry():
    with pytest.raises(ValueError, match=r"^loss: must be one of \[" + ", ".join(repr(n) for n in sorted(LOSSES))):
        ObjectiveConfig(loss="ppo")
    for name in LOSSES:
        ObjectiveConfig(loss=name)  # every registered name is accepted with its defaults
    fields = ObjectiveConfig.__dataclass_fields__
    for knob in losses.knobs():
        assert fields[knob.name].default == knob.default
        assert ObjectiveConfig(**{knob.name: knob.default}) is not None
    with pytest.raises(ValueError, match=r"^gspo_eps_low: must be in \[0, 1\], got 2.0"):
        ObjectiveConfig(gspo_eps_low=2.0)
    with pytest.raises(ValueError, match=r"^eps_high_is: must be >= 0"):
        ObjectiveConfig(loss="cispo", eps_high_is=-1.0)


def test_registration_refuses_duplicates_and_takes_knobs_after_the_config_was_built():
    with pytest.raises(ValueError, match="'grpo' is already registered"):
        register_loss("grpo", equation="", paper="")(lambda x, cfg: None)
    built_before = ObjectiveConfig()
    register_loss("toy_knobbed", equation="", paper="", knobs=(Knob("toy_knob", 1.0, float, "a knob", non_negative),))(
        lambda x, cfg: None)
    try:
        cfg = load_config(TrainConfig, overrides=["objective.loss=toy_knobbed", "objective.toy_knob=2"])
        assert cfg.objective.toy_knob == 2.0 and to_dict(cfg)["objective"]["toy_knob"] == 2.0
        assert ObjectiveConfig().toy_knob == 1.0 and built_before.toy_knob == 1.0  # the default, before and after
        with pytest.raises(ConfigError, match=r"objective\.toy_knob: must be >= 0, got -1.0"):
            load_config(TrainConfig, overrides=["objective.toy_knob=-1"])
    finally:
        del LOSSES["toy_knobbed"]
        registry.prune_knobs()
    assert "toy_knob" not in ObjectiveConfig.__dataclass_fields__
    with pytest.raises(ConfigError, match="unknown key objective.toy_knob"):
        load_config(TrainConfig, overrides=["objective.toy_knob=2"])


def test_kernel_codes_must_name_registered_per_token_losses(monkeypatch):
    _check_kernel_codes()
    monkeypatch.setitem(kernels.LOSS_CODES, "gspo", 99)  # a kernel for a loss that needs whole sequences
    with pytest.raises(RuntimeError, match="LOSS_CODES has a kernel for 'gspo'"):
        _check_kernel_codes()
    monkeypatch.delitem(kernels.LOSS_CODES, "gspo")
    monkeypatch.setitem(kernels.CORRECTION_CODES, "sequence_mask", 2)
    with pytest.raises(RuntimeError, match="CORRECTION_CODES has 'sequence_mask'"):
        _check_kernel_codes()


@pytest.mark.parametrize("entry", [*LOSSES.values(), *CORRECTIONS.values()], ids=lambda e: e.name)
def test_every_registered_entry_has_its_preset(entry):
    if entry.preset is None:
        assert entry.name == "none"
        return
    cfg = ObjectiveConfig(**read_yaml(ROOT / "configs" / "objectives" / f"{entry.preset}.yaml")["objective"])
    assert entry.name in (cfg.loss, cfg.correction)


def test_docs_list_every_loss_and_correction_as_the_registry_says():
    text = (ROOT / "docs" / "objectives.md").read_text()
    block = text.split(losses.DOCS_BEGIN)[1].split(losses.DOCS_END)[0]
    assert block.strip() == losses.markdown().strip(), \
        "docs/objectives.md is stale: python -m grpo.losses --write docs/objectives.md"
    for name in [*LOSSES, *CORRECTIONS]:
        assert f"| `{name}` |" in block, name
    assert "## Adding a loss" in text
