import copy
import math
import subprocess
import sys

import pytest
import torch
from torch import nn

from openalign.optim import (
    GroupLRScheduler,
    Lamb,
    OptimConfig,
    _base_method,
    build_optimizer,
    build_schedule,
    build_scheduler,
    constant,
    param_groups,
    step_decay,
    warmup_cosine,
    warmup_linear_decay,
)

# ----------------------------------------------------------------------------------------------------------
# LAMB against the algorithm written out by hand
# ----------------------------------------------------------------------------------------------------------


class HandLamb:
    """LAMB for one tensor, spelled out with plain tensor maths (float64)."""

    def __init__(self, w, lr, beta1, beta2, eps, wd, trust, bias_correction=True):
        self.w = w.clone()
        self.m = torch.zeros_like(w)
        self.v = torch.zeros_like(w)
        self.t = 0
        self.lr, self.beta1, self.beta2, self.eps, self.wd = lr, beta1, beta2, eps, wd
        self.trust, self.bias_correction = trust, bias_correction

    def step(self, g):
        self.t += 1
        self.m = self.beta1 * self.m + (1 - self.beta1) * g
        self.v = self.beta2 * self.v + (1 - self.beta2) * g * g
        m_hat, v_hat = self.m, self.v
        if self.bias_correction:
            m_hat = self.m / (1 - self.beta1**self.t)
            v_hat = self.v / (1 - self.beta2**self.t)
        r = m_hat / (torch.sqrt(v_hat) + self.eps)
        u = r + self.wd * self.w
        ratio = 1.0
        if self.trust:
            w_norm = torch.sqrt((self.w * self.w).sum())
            u_norm = torch.sqrt((u * u).sum())
            if w_norm > 0 and u_norm > 0:
                ratio = w_norm / u_norm
        self.w = self.w - self.lr * ratio * u
        return ratio


def _grads(shape, n, seed):
    gen = torch.Generator().manual_seed(seed)
    # Different scales per step so m and v genuinely mix old and new gradients.
    return [torch.randn(shape, generator=gen, dtype=torch.float64) * s for s in (0.3, 2.0, 0.05)[:n]]


@pytest.mark.parametrize("bias_correction", [True, False])
def test_lamb_three_steps_match_hand_computation(bias_correction):
    lr, betas, eps, wd = 0.05, (0.9, 0.999), 1e-3, 0.1
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(3, 4, generator=gen, dtype=torch.float64) * 5.0  # ||w|| far from ||u||: trust != 1
    b0 = torch.randn(4, generator=gen, dtype=torch.float64)
    w = nn.Parameter(w0.clone())
    b = nn.Parameter(b0.clone())
    opt = Lamb(
        [
            {"params": [w], "weight_decay": wd, "trust_ratio": True},
            {"params": [b], "weight_decay": 0.0, "trust_ratio": False},
        ],
        lr=lr,
        betas=betas,
        eps=eps,
        bias_correction=bias_correction,
    )
    hand_w = HandLamb(w0, lr, *betas, eps, wd, trust=True, bias_correction=bias_correction)
    hand_b = HandLamb(b0, lr, *betas, eps, 0.0, trust=False, bias_correction=bias_correction)
    ratios = []
    for gw, gb in zip(_grads((3, 4), 3, 1), _grads((4,), 3, 2), strict=True):
        w.grad, b.grad = gw.clone(), gb.clone()
        opt.step()
        ratios.append(float(hand_w.step(gw)))
        hand_b.step(gb)
        torch.testing.assert_close(w.detach(), hand_w.w, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(b.detach(), hand_b.w, rtol=1e-12, atol=1e-12)
    assert all(r > 1.5 for r in ratios), ratios  # the trust ratio really was exercised
    assert opt.state[w]["step"] == 3


def test_lamb_on_a_model_matches_the_per_parameter_reference_over_steps():
    """The bucketed foreach update, over many tensors of several shapes with the paper's exclusions (biases,
    norms and a declared parameter: no decay, no trust), equals the per-parameter algorithm step by step."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3)
            self.bn = nn.BatchNorm2d(8)
            self.fc = nn.Linear(8, 5)
            self.ln = nn.LayerNorm(5)
            self.emb = nn.Embedding(7, 5)
            self.scale = nn.Parameter(torch.tensor(0.7))

        def no_weight_decay(self) -> set[str]:
            return {"scale"}

    torch.manual_seed(0)
    net = Net()
    lr, betas, eps, wd = 0.01, (0.9, 0.999), 1e-6, 0.05
    groups = param_groups(net, wd)
    opt = Lamb(groups, lr=lr, betas=betas, eps=eps)
    hands = {
        p: HandLamb(p.detach().double(), lr, *betas, eps, g["weight_decay"], trust=g["trust_ratio"])
        for g in groups
        for p in g["params"]
    }
    excluded = {p for g in groups if not g["trust_ratio"] for p in g["params"]}
    assert net.fc.bias in excluded and net.bn.weight in excluded and net.ln.weight in excluded
    assert net.scale in excluded and net.fc.weight not in excluded and net.emb.weight not in excluded
    gen = torch.Generator().manual_seed(1)
    for step in range(5):
        for p, hand in hands.items():
            p.grad = torch.randn(p.shape, generator=gen) * (0.1 + step)
            hand.step(p.grad.double())
        opt.step()
        for p, hand in hands.items():
            torch.testing.assert_close(p.detach().double(), hand.w, rtol=1e-6, atol=1e-7)


def test_lamb_excluded_group_is_adam_and_decayed_untrusted_group_is_adamw():
    gen = torch.Generator().manual_seed(3)
    init = torch.randn(5, 3, generator=gen, dtype=torch.float64)
    grads = _grads((5, 3), 3, 4)
    for wd, reference in ((0.0, torch.optim.Adam), (0.2, torch.optim.AdamW)):
        p, q = nn.Parameter(init.clone()), nn.Parameter(init.clone())
        lamb = Lamb([p], lr=0.01, eps=1e-6, weight_decay=wd, trust_ratio=False)
        ref = reference([q], lr=0.01, eps=1e-6, weight_decay=wd)
        for g in grads:
            p.grad, q.grad = g.clone(), g.clone()
            lamb.step()
            ref.step()
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)


def test_lamb_zero_norm_weight_gives_trust_one():
    eps, lr = 1e-6, 0.1
    g = torch.tensor([[0.5, -2.0], [1.0, 0.0]], dtype=torch.float64)
    w = nn.Parameter(torch.zeros(2, 2, dtype=torch.float64))
    opt = Lamb([w], lr=lr, eps=eps, weight_decay=0.1)
    w.grad = g.clone()
    opt.step()
    # First bias-corrected step: m_hat = g, v_hat = g^2, so r = g / (|g| + eps) and w = -lr * r.
    torch.testing.assert_close(w.detach(), -lr * g / (g.abs() + eps), rtol=1e-12, atol=1e-15)


def test_lamb_zero_update_leaves_weight_and_zero_grad_shrinks_by_lr():
    w0 = torch.tensor([[3.0, -4.0]], dtype=torch.float64)
    w = nn.Parameter(w0.clone())
    opt = Lamb([w], lr=0.1, weight_decay=0.0)
    w.grad = torch.zeros_like(w)
    opt.step()  # u = 0: trust defaults to 1 instead of dividing by zero
    torch.testing.assert_close(w.detach(), w0)

    w = nn.Parameter(w0.clone())
    opt = Lamb([w], lr=0.1, weight_decay=0.01)
    w.grad = torch.zeros_like(w)
    opt.step()  # u = wd * w, trust = 1 / wd, so the step is exactly lr * w
    torch.testing.assert_close(w.detach(), 0.9 * w0, rtol=1e-12, atol=0)


def test_lamb_max_trust_ratio_clamps():
    w0 = torch.full((4, 4), 10.0, dtype=torch.float64)
    g = torch.ones(4, 4, dtype=torch.float64)
    w = nn.Parameter(w0.clone())
    opt = Lamb([w], lr=0.01, eps=0.0, max_trust_ratio=2.0)
    w.grad = g
    opt.step()
    # Unclamped trust would be ||w|| / ||1|| = 10; the clamp caps the step at 2 * lr * u with u = 1.
    torch.testing.assert_close(w.detach(), w0 - 0.02, rtol=0, atol=1e-12)


def test_lamb_skips_missing_grads_and_rejects_sparse():
    a, b = nn.Parameter(torch.ones(2, 2)), nn.Parameter(torch.ones(2))
    opt = Lamb([a, b])
    a.grad = torch.ones(2, 2)
    opt.step()
    assert torch.equal(b, torch.ones(2)) and b not in opt.state
    assert not torch.equal(a, torch.ones(2, 2))

    emb = nn.Embedding(5, 3, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        Lamb(emb.parameters()).step()


def test_lamb_rejects_bad_hyperparameters():
    p = [nn.Parameter(torch.ones(1))]
    for kw in ({"lr": -1.0}, {"betas": (0.9, 1.0)}, {"eps": -1.0}, {"weight_decay": -0.1}):
        with pytest.raises(ValueError):
            Lamb(p, **kw)
    with pytest.raises(ValueError, match="max_trust_ratio"):
        Lamb([{"params": p, "max_trust_ratio": 0.0}])


# ----------------------------------------------------------------------------------------------------------
# param_groups
# ----------------------------------------------------------------------------------------------------------


class ScaledNorm(nn.Module):
    """A custom norm layer outside torch's classes: it must declare its own weight."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def no_weight_decay(self):
        return {"weight"}

    def forward(self, x):
        return x * self.weight


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.image = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 1, bias=False))
        self.text = nn.ModuleDict(
            {
                "embed": nn.Embedding(10, 4),
                "proj": nn.Linear(4, 4),
                "ln": nn.LayerNorm(4),
                "sn": ScaledNorm(4),
            }
        )
        self.gain = nn.Parameter(torch.ones(4))  # 1-d, no declared role: decayed by design
        self.temperature_param = nn.Parameter(torch.tensor(0.07))
        self.frozen = nn.Parameter(torch.ones(2, 2), requires_grad=False)

    def no_weight_decay(self):
        return {"temperature_param"}


# Order is model.named_parameters() order: the root's own parameters come first.
DECAYED = ["gain", "image.0.weight", "image.2.weight", "text.embed.weight", "text.proj.weight"]
EXCLUDED = [
    "temperature_param",
    "image.0.bias",
    "image.1.weight",
    "image.1.bias",
    "text.proj.bias",
    "text.ln.weight",
    "text.ln.bias",
    "text.sn.weight",
]


def test_param_groups_split_by_module_type_and_declaration():
    model = Tiny()
    groups = param_groups(model, 1e-5)
    assert len(groups) == 2
    decayed, excluded = groups
    assert decayed["names"] == DECAYED
    assert excluded["names"] == EXCLUDED
    assert (decayed["weight_decay"], decayed["trust_ratio"], decayed["lr_scale"]) == (1e-5, True, 1.0)
    assert (excluded["weight_decay"], excluded["trust_ratio"], excluded["lr_scale"]) == (0.0, False, 1.0)
    params = dict(model.named_parameters())
    for g in groups:
        assert all(p is params[n] for p, n in zip(g["params"], g["names"], strict=True))


def test_param_groups_lr_scales_exact_and_prefix():
    groups = param_groups(Tiny(), 1e-5, lr_scales={"image.": 0.1, "image.1.": 0.5, "temperature_param": 10.0})
    by_key = {(g["trust_ratio"], g["lr_scale"]): g["names"] for g in groups}
    assert by_key == {
        (True, 0.1): ["image.0.weight", "image.2.weight"],
        (True, 1.0): ["gain", "text.embed.weight", "text.proj.weight"],
        (False, 0.1): ["image.0.bias"],
        (False, 0.5): ["image.1.weight", "image.1.bias"],  # longest prefix wins
        (False, 1.0): ["text.proj.bias", "text.ln.weight", "text.ln.bias", "text.sn.weight"],
        (False, 10.0): ["temperature_param"],
    }
    assert [g["trust_ratio"] for g in groups] == [True, True, False, False, False, False]


def test_param_groups_tied_weights_and_typos():
    model = Tiny()
    model.head = nn.Linear(4, 10, bias=False)
    model.head.weight = model.text["embed"].weight  # tied: listed once, under its first name
    names = [n for g in param_groups(model, 0.1) for n in g["names"]]
    assert names.count("text.embed.weight") == 1 and "head.weight" not in names
    with pytest.raises(ValueError, match=r"match no parameter: imgae\."):
        param_groups(model, 0.1, lr_scales={"imgae.": 0.1})
    with pytest.raises(ValueError, match="conflicting"):
        param_groups(model, 0.1, lr_scales={"text.": 1.0, "head.": 2.0})
    model.no_weight_decay = lambda: {"temperature"}
    with pytest.raises(ValueError, match="unknown parameters: temperature"):
        param_groups(model, 0.1)


# ----------------------------------------------------------------------------------------------------------
# Schedules
# ----------------------------------------------------------------------------------------------------------


def test_warmup_linear_decay_values():
    f = lambda s: warmup_linear_decay(s, 100, 1100)  # noqa: E731
    assert [f(s) for s in (0, 50, 100, 600, 1100, 5000)] == [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    assert f(1099) == pytest.approx(1 / 1000)
    assert warmup_linear_decay(0, 0, 10) == 1.0 and warmup_linear_decay(5, 0, 10) == 0.5
    # Horizon before the end of warmup: keep ramping, then stop at total_steps.
    assert [warmup_linear_decay(s, 100, 50) for s in (25, 49, 50)] == [0.25, 0.49, 0.0]
    with pytest.raises(ValueError):
        warmup_linear_decay(0, -1, 10)


def test_warmup_cosine_step_and_constant_values():
    f = lambda s: warmup_cosine(s, 10, 110, final=0.1)  # noqa: E731
    assert f(0) == 0.0 and f(5) == 0.5 and f(10) == 1.0
    assert f(60) == pytest.approx(0.55) and f(35) == pytest.approx(0.1 + 0.9 * (0.5 + 0.5 * math.cos(math.pi / 4)))
    assert f(110) == pytest.approx(0.1) and f(1000) == pytest.approx(0.1)
    assert [step_decay(s, 30, 0.2) for s in (0, 29, 30, 59, 60)] == pytest.approx([1, 1, 0.2, 0.2, 0.04])
    assert [constant(s) for s in (0, 7)] == [1.0, 1.0]
    assert [constant(s, warmup_steps=4) for s in (0, 2, 4, 100)] == [0.0, 0.5, 1.0, 1.0]


def test_build_schedule_names_and_errors():
    assert build_schedule("warmup_linear_decay", warmup_steps=10, total_steps=20)(15) == 0.5
    with pytest.raises(ValueError, match="valid: constant, step_decay, warmup_cosine, warmup_linear_decay"):
        build_schedule("linear")
    with pytest.raises(ValueError, match="accepts: every, gamma"):
        build_schedule("step_decay", every=3, gama=0.1)
    with pytest.raises(ValueError, match="every"):
        build_schedule("step_decay", every=0, gamma=0.1)


def _tiny_optimizer(lr=1.0):
    cfg = OptimConfig(name="sgd", lr=lr, lr_scales={"image.": 0.1}, schedule="constant", warmup_steps=0)
    return build_optimizer(Tiny(), cfg)


def test_schedule_with_lambdalr_and_group_scheduler_respect_lr_scale():
    fn = build_schedule("warmup_linear_decay", warmup_steps=4, total_steps=12)
    expected = [fn(s) for s in range(14)]
    assert expected[:5] == [0.0, 0.25, 0.5, 0.75, 1.0] and expected[8] == 0.5 and expected[12:] == [0.0, 0.0]

    opt = _tiny_optimizer()
    scales = [g["lr_scale"] for g in opt.param_groups]
    assert scales == [1.0, 0.1, 1.0, 0.1]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, fn)
    got = []
    for _ in range(14):
        got.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected)[:, None] * torch.tensor(scales))

    opt = _tiny_optimizer(lr=0.5)  # the group scheduler takes the peak from its own argument
    sched = GroupLRScheduler(opt, 2.0, fn)
    got = []
    for _ in range(14):
        got.append(sched.get_last_lr())
        opt.step()
        sched.step()
    torch.testing.assert_close(torch.tensor(got), 2.0 * torch.tensor(expected)[:, None] * torch.tensor(scales))


# ----------------------------------------------------------------------------------------------------------
# Config and builders
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["lamb", "adamw", "sgd"])
def test_build_optimizer_and_state_dict_round_trip(name):
    torch.manual_seed(0)
    cfg = OptimConfig(name=name, lr=0.01, weight_decay=0.01, warmup_steps=2, total_steps=10)
    model = Tiny()
    opt = build_optimizer(model, cfg)
    expected_type = {"lamb": Lamb, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[name]
    assert type(opt) is expected_type
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
    sched = build_scheduler(opt, cfg)
    x = torch.randn(2, 3, 5, 5)
    tokens = torch.tensor([1, 2, 3])

    def train_step(m, o, s):
        o.zero_grad()
        img = m.image(x).mean()
        txt = m.text["sn"](m.text["ln"](m.text["proj"](m.text["embed"](tokens)))).pow(2).mean()
        (img * txt / m.temperature_param + m.gain.sum()).backward()
        o.step()
        s.step()

    for _ in range(3):
        train_step(model, opt, sched)
    clone = copy.deepcopy(model)
    opt2 = build_optimizer(clone, cfg)
    sched2 = build_scheduler(opt2, cfg)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    sched2.load_state_dict(sched.state_dict())
    assert sched2.get_last_lr() == sched.get_last_lr()
    for _ in range(2):
        train_step(model, opt, sched)
        train_step(clone, opt2, sched2)
    for (n, p), (_, q) in zip(model.named_parameters(), clone.named_parameters(), strict=True):
        assert torch.equal(p, q), n


def test_sgd_step_decay_recipe():
    cfg = OptimConfig(
        name="sgd", lr=0.1, schedule="step_decay", decay_every=30, decay_gamma=0.2, lr_scales={"image.": 0.1}
    )
    opt = build_optimizer(Tiny(), cfg)
    sched = build_scheduler(opt, cfg)
    assert opt.param_groups[0]["momentum"] == 0.9
    lrs = {}
    for epoch in range(61):
        lrs[epoch] = sorted(sched.get_last_lr())
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx([0.01, 0.01, 0.1, 0.1]) and lrs[29] == lrs[0]
    assert lrs[30] == pytest.approx([0.002, 0.002, 0.02, 0.02])
    assert lrs[60] == pytest.approx([0.0004, 0.0004, 0.004, 0.004])


def test_config_defaults_are_the_paper_recipe():
    cfg = OptimConfig()
    assert (cfg.name, cfg.lr, cfg.weight_decay, cfg.betas, cfg.eps) == (
        "lamb",
        1e-3,
        1e-5,
        (0.9, 0.999),
        1e-6,
    )
    assert (cfg.schedule, cfg.warmup_steps, cfg.total_steps) == ("warmup_linear_decay", 10_000, 1_200_000)
    assert OptimConfig(betas=[0.8, 0.9]).betas == (0.8, 0.9)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"name": "adam"}, "valid: adamw, lamb, sgd"),
        ({"lr": -1e-3}, "lr must be finite and > 0"),
        ({"lr": 0.0}, "lr must be finite and > 0"),
        ({"lr": float("inf")}, "lr must be finite and > 0"),
        ({"lr": float("nan")}, "lr must be finite and > 0"),
        ({"weight_decay": float("nan")}, "weight_decay must be finite"),
        ({"weight_decay": float("inf")}, "weight_decay must be finite"),
        ({"eps": float("inf")}, "eps must be finite"),
        ({"lr_scales": {"image.": float("inf")}}, "lr_scales"),
        ({"schedule": "step_decay", "decay_every": 3, "decay_gamma": float("inf")}, "gamma must be finite"),
        ({"schedule": "cosine"}, "valid: constant, step_decay"),
        ({"schedule": "step_decay"}, "decay_every"),
        ({"warmup_steps": -5}, "warmup_steps"),
        ({"momentum": 1.5}, "momentum"),
        ({"lr_scales": {"image.": -1.0}}, "lr_scales"),
    ],
)
def test_bad_config_raises_one_line(kw, match):
    with pytest.raises(ValueError, match=match) as info:
        OptimConfig(**kw)
    assert "\n" not in str(info.value)
    cfg = OptimConfig()
    cfg.name = "adam"  # mutated after construction: the builder checks again
    with pytest.raises(ValueError, match="valid: adamw, lamb, sgd"):
        build_optimizer(Tiny(), cfg)


# A fresh interpreter: LAMB's methods and an eager training run on a CPU with checkpoints, then whether
# torch._dynamo was imported (the pytest process has it loaded by other tests).
NO_DYNAMO = """
import copy, sys
import torch
from openalign.optim import OptimConfig, build_optimizer
model = torch.nn.Linear(4, 4)
opt = build_optimizer(model, OptimConfig(lr=0.01, weight_decay=0.01, warmup_steps=1, total_steps=4))
opt.zero_grad()
model(torch.ones(2, 4)).sum().backward()
opt.step()
twin = build_optimizer(copy.deepcopy(model), OptimConfig(lr=0.01, weight_decay=0.01, warmup_steps=1, total_steps=4))
twin.load_state_dict(copy.deepcopy(opt.state_dict()))
assert str(twin.state_dict()) == str(opt.state_dict())
from openalign.train.config import load_train_config
from openalign.train.loop import train
cfg = load_train_config("nano_cpu", {
    "data.source": "synthetic", "data.workers": 0, "model.image_size": 32, "train.batch_size": 8, "train.steps": 2,
    "train.run_dir": sys.argv[1], "train.checkpoint_every": 1, "eval.every": 0,
    "log.progress": False, "log.tensorboard": False,
})
assert train(cfg).step == 2
print("torch._dynamo" in sys.modules)
"""


def test_eager_training_with_lamb_never_imports_dynamo(tmp_path) -> None:
    # torch.optim wraps four Optimizer methods so that their first call imports torch._dynamo (2.8 s of a
    # two-core CPU, as long as torch's own import); a process that compiles nothing has no use for it.
    run = [sys.executable, "-c", NO_DYNAMO, str(tmp_path / "run")]
    out = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "False"


def test_lamb_calls_torchs_own_optimizer_methods_once_dynamo_is_loaded() -> None:
    import torch._dynamo

    opt = Lamb(nn.Linear(2, 2).parameters())
    for method in ("add_param_group", "zero_grad", "state_dict", "load_state_dict"):
        assert _base_method(method) is getattr(torch.optim.Optimizer, method)
    opt.zero_grad()
    opt.load_state_dict(opt.state_dict())
