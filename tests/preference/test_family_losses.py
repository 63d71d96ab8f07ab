"""KTO, ORPO and CPO/SimPO losses as pure functions: against TRL's own loss methods (CPO, ORPO) on random
log-probabilities, and against the papers' formulas written out here (KTO, whose TRL loss is inline in its
trainer; the trainer-level comparison with TRL is in test_kto.py)."""

from __future__ import annotations

import decimal
import math
from types import SimpleNamespace

import pytest
import torch

from shardkit.preference.cpo import CPO_LOSS_TYPES, CPOConfig, averages_logps, cpo_loss
from shardkit.preference.kto import KTOConfig, kto_kl, kto_loss
from shardkit.preference.orpo import ORPOConfig, log1mexp, odds_ratio_loss


def _logps(n: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return -torch.rand(n, generator=g, dtype=torch.float64) * scale - 1e-3


def _trl_self(**fields):
    return SimpleNamespace(accelerator=SimpleNamespace(device=torch.device("cpu")), **fields)


@pytest.mark.parametrize("loss_type", CPO_LOSS_TYPES)
@pytest.mark.parametrize("alpha", [0.0, 0.25])
def test_cpo_losses_equal_trls(loss_type, alpha):
    cpo = pytest.importorskip("trl.experimental.cpo.cpo_trainer")
    chosen, rejected = _logps(16, 0), _logps(16, 1)
    smoothing = 0.1 if loss_type in ("sigmoid", "simpo") else 0.0
    settings = dict(beta=0.3, loss_type=loss_type, label_smoothing=smoothing, simpo_gamma=0.7, alpha=alpha)
    want = cpo.CPOTrainer.cpo_loss(_trl_self(**settings), chosen, rejected)
    got = cpo_loss(chosen, rejected, **settings)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


def test_simpo_is_the_margin_minus_gamma_through_a_log_sigmoid():
    chosen, rejected = _logps(8, 2), _logps(8, 3)
    losses, chosen_rewards, rejected_rewards = cpo_loss(chosen, rejected, beta=2.0, loss_type="simpo",
                                                        simpo_gamma=0.5)
    by_hand = [-math.log(1 / (1 + math.exp(-(2.0 * (c - r) - 0.5)))) for c, r in zip(chosen.tolist(),
                                                                                      rejected.tolist())]
    torch.testing.assert_close(losses, torch.tensor(by_hand, dtype=torch.float64))
    torch.testing.assert_close(chosen_rewards, 2.0 * chosen)
    assert averages_logps("simpo") and averages_logps("ipo") and not averages_logps("sigmoid")


def test_odds_ratio_loss_equals_trls():
    orpo = pytest.importorskip("trl.experimental.orpo.orpo_trainer")
    chosen, rejected = _logps(16, 4, 2.0), _logps(16, 5, 2.0)
    want = orpo.ORPOTrainer.odds_ratio_loss(_trl_self(beta=0.25), chosen, rejected)
    got = odds_ratio_loss(chosen, rejected, beta=0.25)
    torch.testing.assert_close(got[0], -want[0], rtol=0, atol=0)  # TRL returns the term the loss subtracts
    for w, g in zip(want[1:3], got[1:3]):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    for w, g in zip(want[3:], got[3:]):  # TRL returns the means of the per-pair values
        torch.testing.assert_close(g.mean(), w, rtol=1e-6, atol=0)


def test_log1mexp_is_exact_on_both_sides_of_the_split():
    x = torch.tensor([-1e-8, -0.1, -0.69, -0.7, -5.0, -40.0], dtype=torch.float64)
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        want = torch.tensor([float((1 - decimal.Decimal(v).exp()).ln()) for v in x.tolist()], dtype=torch.float64)
    torch.testing.assert_close(log1mexp(x), want, rtol=1e-14, atol=0)


def test_odds_ratio_is_the_log_sigmoid_of_the_log_odds():
    chosen, rejected = torch.tensor([-0.5], dtype=torch.float64), torch.tensor([-2.0], dtype=torch.float64)
    losses, *_, ratio, log_odds = odds_ratio_loss(chosen, rejected, beta=0.1)
    assert ratio.item() == pytest.approx(math.log(1 / (1 + math.exp(-log_odds.item()))), rel=1e-6)
    pc, pr = math.exp(-0.5), math.exp(-2.0)
    odds = math.log(pc / (1 - pc)) - math.log(pr / (1 - pr))
    assert log_odds.item() == pytest.approx(odds, rel=1e-6)  # in float32, as TRL
    assert losses.item() == pytest.approx(-0.1 * math.log(1 / (1 + math.exp(-odds))), rel=1e-6)


def test_kto_loss_is_the_papers():
    chosen, rejected = _logps(5, 6), _logps(3, 7)
    ref_chosen, ref_rejected = _logps(5, 8), _logps(3, 9)
    kl = torch.tensor(0.2, dtype=torch.float64)
    losses, chosen_rewards, rejected_rewards = kto_loss(chosen, rejected, ref_chosen, ref_rejected, kl, beta=0.5,
                                                        desirable_weight=2.0, undesirable_weight=0.5)
    sig = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    want = [2.0 * (1 - sig(0.5 * (c - rc - 0.2))) for c, rc in zip(chosen.tolist(), ref_chosen.tolist())]
    want += [0.5 * (1 - sig(0.5 * (0.2 - (r - rr)))) for r, rr in zip(rejected.tolist(), ref_rejected.tolist())]
    torch.testing.assert_close(losses, torch.tensor(want, dtype=torch.float64))
    torch.testing.assert_close(chosen_rewards, 0.5 * (chosen - ref_chosen))
    torch.testing.assert_close(rejected_rewards, 0.5 * (rejected - ref_rejected))


def test_apo_zero_unpaired_ignores_the_kl_and_an_empty_side_is_fine():
    chosen, ref_chosen = _logps(4, 10), _logps(4, 11)
    empty = torch.empty(0, dtype=torch.float64)
    a = kto_loss(chosen, empty, ref_chosen, empty, torch.tensor(5.0), loss_type="apo_zero_unpaired")[0]
    b = kto_loss(chosen, empty, ref_chosen, empty, torch.tensor(0.0), loss_type="apo_zero_unpaired")[0]
    torch.testing.assert_close(a, b)
    assert a.shape == (4,)


def test_kto_kl_is_a_detached_batch_mean_clamped_at_zero():
    policy = torch.tensor([-1.0, -2.0], requires_grad=True)
    assert kto_kl(policy, torch.tensor([-1.5, -2.5])).item() == pytest.approx(0.5)
    assert kto_kl(policy, torch.tensor([-0.5, -1.5])).item() == 0.0
    assert not kto_kl(policy, torch.tensor([-1.5, -2.5])).requires_grad
    assert kto_kl(policy, torch.tensor([-1.5, -2.5]), lambda t: t * 3).item() == pytest.approx(1.5)


def test_configs_take_trls_names_and_refuse_what_is_not_run(tmp_path):
    out = str(tmp_path)
    alphapo = CPOConfig(out, loss_type="alphapo")
    assert (alphapo.loss_type, alphapo.cpo_alpha) == ("simpo", 0.0)
    assert KTOConfig(out).train_sampling_strategy == "sequential" and KTOConfig(out).pad_to_multiple_of is None
    with pytest.raises(ValueError, match="did you mean 'simpo'"):
        CPOConfig(out, loss_type="simpoo")
    with pytest.raises(ValueError, match="label_smoothing.*hinge"):
        CPOConfig(out, loss_type="hinge", label_smoothing=0.1)
    with pytest.raises(ValueError, match="KTOConfig.precompute_ref_log_probs=True is not supported"):
        KTOConfig(out, precompute_ref_log_probs=True)
    with pytest.raises(ValueError, match="ORPOConfig.is_encoder_decoder=True is not supported"):
        ORPOConfig(out, is_encoder_decoder=True)
    with pytest.raises(ValueError, match="ORPOConfig.generate_during_eval"):
        ORPOConfig(out, generate_during_eval=True)
    with pytest.raises(ValueError, match="KTOConfig.loss_type='sigmoid' is not one of"):
        KTOConfig(out, loss_type="sigmoid")
    with pytest.raises(ValueError, match="beta"):
        ORPOConfig(out, beta=0)
