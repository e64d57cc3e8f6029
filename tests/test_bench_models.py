"""bench.models on CPU: every config kind parses; the gpt chain builds, trains, runs early."""
import pytest
import torch

from bench import models
from bench.models import ChainConfig, GPTConfig, GPTChain, parse_config
from bench.vision import VisionConfig


@pytest.mark.parametrize("text, kind", [
    ("ctr:1024:512:1024:6", ChainConfig), ("mlp:128:2000:2000:4", ChainConfig),
    ("ctr-towers:4096:1024:2048:6", ChainConfig), ("mlp-towers-top:8:16:32:3", ChainConfig),
    ("gpt:8:768:1024:6", GPTConfig), ("gpt:16:384:256:8", GPTConfig),
    ("gpt-soft:16:384:256:8", GPTConfig), ("gpt-fp16:16:384:256:8", GPTConfig),
    ("tv-resnet18:256:32", VisionConfig), ("tv-resnet18-dgl:256:32", VisionConfig),
    ("tv-googlenet-aux:128:64", VisionConfig), ("tv-mobilenet-dgl:256:64", VisionConfig),
    ("tv-efficientnet-dgl:128:64", VisionConfig), ("tv-vit-dgl:256:32", VisionConfig),
])
def test_every_config_kind_parses_and_prints_back(text, kind):
    cfg = parse_config(text)
    assert isinstance(cfg, kind) and str(cfg) == text


@pytest.mark.parametrize("text, message", [
    ("gpt:8:768:1024", "is not one of gpt:B:d:T:K, gpt-soft:B:d:T:K, gpt-fp16:B:d:T:K"),
    ("gpt:8:100:1024:6", "multiple of 64"),
    ("tv-resnet18-dgl:256", "is not name:B:image"),
    ("tv-resnet50:256:32", "with name one of tv-resnet18"),
    ("mlp:1:2:3", "is not kind:B:d:h:K"),
    ("transformer:1:2:3:4", "gpt, gpt-soft or gpt-fp16 (gpt:B:d:T:K)"),
    ("gpt-soft:8:768:1024", "is not one of gpt:B:d:T:K"),
])
def test_malformed_configs_say_what_is_expected(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_config(text)


def test_gpt_config_fields():
    cfg = parse_config("gpt:8:768:1024:6")
    assert (cfg.batch, cfg.d, cfg.seq, cfg.blocks, cfg.heads) == (8, 768, 1024, 6, 12)
    assert parse_config("gpt:16:384:256:8").heads == 6
    assert not models.takes_paper_scheme(cfg) and not models.is_random(cfg)
    assert models.takes_paper_scheme(parse_config("mlp:8:16:32:3"))
    assert not models.takes_paper_scheme(parse_config("mlp-towers:8:16:32:3"))
    # 6 x tokens x multiply-adds: 12 d^2 + d V + T d per block and token
    assert models.config_flops(cfg) == 6 * 8 * 1024 * 6 * (12 * 768**2 + 768 * 8192 + 1024 * 768)
    assert models.config_flops(parse_config("tv-vit-dgl:256:32")) is None


def tiny_gpt(amp_dtype=None, kind="gpt"):
    cfg = GPTConfig.parse(f"{kind}:2:64:8:3")
    return cfg, GPTChain(cfg, amp_dtype=amp_dtype)


def test_gpt_chain_trains_one_step_on_cpu():
    cfg, model = tiny_gpt()
    tokens, targets = models.gpt_inputs(cfg, torch.device("cpu"))
    assert tokens.shape == targets.shape == (2, 8) and int(tokens.max()) < models.GPT_VOCAB
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss = model(tokens, targets)
    assert loss.shape == () and 3 * 8.5 < float(loss.detach()) < 3 * 9.5  # ~3 x log(8192) at init
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    optimizer.step()
    # each block is trained by its own head only: block 1's loss leaves block 0 alone
    model.zero_grad(set_to_none=True)
    h = model.embed(tokens) + model.position(torch.arange(8))
    h1 = model.blocks[1](model.blocks[0](h).detach())
    logits = model.heads[1](h1).flatten(0, 1)
    torch.nn.functional.cross_entropy(logits, targets.flatten()).backward()
    assert model.blocks[0].attn.qkv.weight.grad is None


def test_gpt_chain_under_bf16_autocast_keeps_fp32_parameters():
    cfg, model = tiny_gpt(torch.bfloat16)
    tokens, targets = models.gpt_inputs(cfg, torch.device("cpu"))
    model(tokens, targets).backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32
               for p in model.parameters())


@pytest.mark.parametrize("kind", ["gpt", "gpt-soft"])
def test_every_gpt_block_but_the_last_runs_early(kind):
    import erase_fx
    from graphs import check_parity

    cfg, model = tiny_gpt(kind=kind)
    with erase_fx.collect_reports() as reports:
        check_parity(model, lambda: models.gpt_inputs(cfg, torch.device("cpu")), steps=1)
    (report,) = reports
    assert len(report.blocks) == cfg.blocks - 1


def test_gpt_soft_learns_label_smoothed_targets_made_in_the_forward():
    cfg = parse_config("gpt-soft:2:64:8:3")
    assert cfg.soft_targets and cfg.kind == "gpt-soft" and not parse_config("gpt:2:64:8:3").soft_targets
    model = GPTChain(cfg, amp_dtype=None)
    tokens, targets = models.gpt_inputs(cfg, torch.device("cpu"))
    h = model.embed(tokens) + model.position(torch.arange(8))
    want = 0
    for k, (block, head) in enumerate(zip(model.blocks, model.heads)):
        h = block(h if k == 0 else h.detach())
        want = want + torch.nn.functional.cross_entropy(
            head(h).flatten(0, 1), targets.flatten(), label_smoothing=models.GPT_SMOOTHING)
    torch.testing.assert_close(model(tokens, targets), want)


def test_gpt_soft_under_erase_sends_only_scalars_to_the_main_stream():
    """Every early block's loss on the shared soft targets (64 tokens x 8192: 2 MiB, above
    the size where erase_fx keeps them off the streams' boundaries) runs in the block: the
    main stream reads no block value but the local losses (Inductor, CPU)."""
    from graphs import Stages, main_reads_of_side_values

    from erase_fx.config import EraseConfig

    cfg = parse_config("gpt-soft:4:64:16:3")
    torch.manual_seed(0)
    model = GPTChain(cfg, amp_dtype=None)
    stages = Stages(model, models.gpt_inputs(cfg, torch.device("cpu")),
                    EraseConfig(inner="inductor"), inner="inductor")
    crossing = main_reads_of_side_values(stages.assigned.gm)
    assert crossing and all(shape == () for _, shape in crossing), crossing


def test_build_config_gives_model_and_batch_of_each_kind():
    cpu = torch.device("cpu")
    chain, inputs = models.build_config(parse_config("mlp:4:16:32:2"), cpu)
    assert isinstance(chain, models.DetachedChain) and len(inputs) == 2
    gpt, (tokens, targets) = models.build_config(parse_config("gpt:2:64:8:2"), cpu)
    assert isinstance(gpt, GPTChain) and gpt.amp_dtype == torch.bfloat16
    assert tokens.shape == (2, 8)
    fp16, _ = models.build_config(parse_config("gpt-fp16:2:64:8:2"), cpu)
    assert fp16.amp_dtype == torch.float16 and fp16.cfg.kind == "gpt-fp16"


def test_gpt_fp16_scales_its_loss_and_learns_its_seed_under_erase():
    """``gpt-fp16``: float16 autocast, the loss times a GradScaler's first scale; erase_fx
    runs its blocks early at the seed it learns (aot_eager on the first step), bitwise as
    eager from then on."""
    import copy

    import erase_fx
    from graphs import assert_same_grads

    cfg = parse_config("gpt-fp16:2:64:8:3")
    torch.manual_seed(0)
    eager = models.build_config(cfg, torch.device("cpu"))[0]
    erased = copy.deepcopy(eager)
    compiled = torch.compile(erased, backend="erase",
                             options={"inner": "aot_eager", "on_error": "raise"})
    with erase_fx.collect_reports() as reports:
        for _ in range(3):
            inputs = models.gpt_inputs(cfg, torch.device("cpu"))
            for module, run in ((eager, eager), (erased, compiled)):
                module.zero_grad(set_to_none=True)
                loss = run(*inputs)
                loss.backward()
            assert 3 * 8.5 * models.GPT_FP16_LOSS_SCALE < float(loss.detach())
            assert_same_grads(eager, erased, rtol=0, atol=0)
    (report,) = reports
    assert report.learned_seed and len(report.blocks) == cfg.blocks - 1


def test_check_models_marks_a_model_cut_by_the_budget_incomplete():
    """A model whose variants the budget cuts is INCOMPLETE, and INCOMPLETE does not pass."""
    from bench import check_models

    def builder(device):
        return torch.nn.Linear(4, 1), (torch.randn(2, 4),)

    row = check_models.check_model("tiny", builder, False, torch.device("cpu"), steps=1,
                                   deadline=0.0)
    assert row["verdict"].startswith("INCOMPLETE (budget spent before stock64")
    assert "stock" not in row


@pytest.mark.parametrize("erase_grads, erase_state, perturbed_state, verdict", [
    (1.0, 1.0, None, "erase PASS"),                      # within twice stock's distance
    (1.0, 1.02, 1.03, "erase PASS (unstable trajectory"),  # stock moves as far by itself
    (1.0, 1.02, 1.0, "erase FAIL"),                      # stock's trajectory is stable
    (1.05, 1.0, None, "erase FAIL"),                     # gradients are never held to less
])
def test_check_models_tells_an_unstable_trajectory_from_a_wrong_one(
        monkeypatch, erase_grads, erase_state, perturbed_state, verdict):
    from bench import check_models

    def run(grads, state):
        return {"grads": {"w": torch.tensor([grads])}, "state": {"w": torch.tensor([state])},
                "reports": []}

    # stock is 1e-3 from the float64 reference, on the first step's grads and the final state
    runs = {"stock64": run(1.0, 1.0), "stock": run(1.001, 1.001),
            "erase": run(erase_grads, erase_state), "erase-nographs": run(1.0, 1.0)}
    perturbed = []

    def train(variant, base, batch, steps, erase_options=None):
        if variant == "stock" and "stock" in seen:  # the second stock run: the perturbed one
            perturbed.append(base)
            return run(1.001, perturbed_state)
        seen.append(variant)
        return runs[variant]

    seen: list[str] = []
    monkeypatch.setattr(check_models, "train", train)
    base = torch.nn.Linear(2, 1)
    row = check_models.check_model("tiny", lambda device: (base, ()), False,
                                   torch.device("cpu"), steps=1)
    assert row["verdict"].startswith(verdict), row["verdict"]
    assert bool(perturbed) == (perturbed_state is not None)  # run only when grads pass
    if perturbed:
        (model,) = perturbed  # a perturbed copy of the model, the model itself untouched
        assert model is not base and not torch.equal(model.weight, base.weight)
        torch.testing.assert_close(model.weight, base.weight, rtol=1e-5, atol=0)
