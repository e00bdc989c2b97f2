"""GPU inference paths (repmlp.deploy.gpu) and CUDA graphs of the training step (repmlp.engine.graph_module).

The CPU tests check what does not need a GPU: which conv epilogues the fx rewrite fuses, and that the
rewritten graph computes the model's function (with the cuDNN ops replaced by their definitions), the path
names and errors, and the engine's fallback when a capture cannot run. The ``cuda`` tests run the paths on
a GPU against the eager model.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import repmlp
from repmlp import reparameterize_model
from repmlp.deploy.gpu import PATHS, GraphReplay, fuse_conv_epilogues, prepare_inference
from repmlp.engine import GraphedModule, resolve_compile, resolve_cuda_graphs
from repmlp.errors import UserError
from zoo import shallow

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _conv_relu(x, weight, bias, stride, padding, dilation, groups):
    return F.relu(F.conv2d(x, weight, bias, stride, padding, dilation, groups))


def _conv_add_relu(x, weight, z, alpha, bias, stride, padding, dilation, groups):
    return F.relu(F.conv2d(x, weight, bias, stride, padding, dilation, groups) + alpha * z)


@pytest.fixture
def cudnn_ops_on_cpu(monkeypatch):
    """The two fused cuDNN ops by their definitions, so that a rewritten graph runs on the CPU."""
    monkeypatch.setattr(torch, "cudnn_convolution_relu", _conv_relu)
    monkeypatch.setattr(torch, "cudnn_convolution_add_relu", _conv_add_relu)


def _expected_fusions(model: nn.Module) -> tuple[int, int]:
    """(conv-ReLU and conv-add-ReLU pairs, conv-add-ReLU alone) of a deployed ResNet: each residual block's
    convs followed by a ReLU, and its last conv with the residual addition."""
    from repmlp.models.resnet import Bottleneck, RepMLPBottleneck, RepMLPLightBlock

    per_block = {Bottleneck: 3, RepMLPBottleneck: 4, RepMLPLightBlock: 2}
    blocks = [type(m) for m in model.modules() if type(m) in per_block]
    return sum(per_block[b] for b in blocks), len(blocks)


@pytest.mark.parametrize("name", ["repmlp_res50", "repmlp_res50_light"])
def test_fused_epilogues_compute_the_model(cudnn_ops_on_cpu, name):
    """Every conv-bias-ReLU and conv-bias-add-ReLU but the 7x7 stem's is fused; the function is unchanged."""
    torch.manual_seed(0)
    model = repmlp.create_model(name, img_size=112, num_classes=10, **shallow(name)).eval()
    deployed = reparameterize_model(model)
    gm, count = fuse_conv_epilogues(deployed)
    fused, with_add = _expected_fusions(deployed)
    assert count == fused
    targets = [node.target for node in gm.graph.nodes]
    assert targets.count(torch.cudnn_convolution_add_relu) == with_add
    assert "self.stem.conv.conv(" in gm.code  # the 7x7 stem stays a plain conv
    x = torch.randn(2, 3, 112, 112)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), deployed(x), rtol=1e-5, atol=1e-5)


def test_nothing_fused_where_a_batchnorm_follows_the_conv():
    """A model with its BatchNorms (not deployed) keeps its convs: only a conv's own bias is fused."""
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
    assert fuse_conv_epilogues(net.eval())[1] == 0


def test_paths_and_errors():
    assert PATHS == ("eager", "graph", "fused", "fused+graph", "compile", "compile+graph")
    model = nn.Conv2d(3, 4, 1).eval()
    x = torch.randn(2, 3, 8, 8)
    assert prepare_inference(model, x, "eager") is model
    with pytest.raises(ValueError, match="unknown inference path 'fast'"):
        prepare_inference(model, x, "fast")
    with pytest.raises(ValueError, match="CUDA graph needs a CUDA input"):
        prepare_inference(model, x, "graph")


def test_cuda_graph_options():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    common = dict(world=1, compile_choice="auto", scaler=False)
    assert not resolve_cuda_graphs("auto", cpu, **common)
    assert resolve_cuda_graphs("auto", cuda, **common)
    assert not resolve_cuda_graphs("auto", cuda, **common, auto=False)  # a task that does not opt in
    assert not resolve_cuda_graphs("auto", cuda, world=2, compile_choice="auto", scaler=False)
    assert not resolve_cuda_graphs("auto", cuda, world=1, compile_choice="on", scaler=False)
    assert not resolve_cuda_graphs("off", cuda, **common)
    for kwargs, why in [
        (dict(world=1, compile_choice="auto", scaler=False), "a CUDA device"),
        (dict(world=2, compile_choice="auto", scaler=False), "one process"),
        (dict(world=1, compile_choice="auto", scaler=True), "gradient scaler"),
        (dict(world=1, compile_choice="on", scaler=False), "no --compile on"),
    ]:
        device = cpu if why == "a CUDA device" else cuda
        with pytest.raises(UserError, match=why):
            resolve_cuda_graphs("on", device, **kwargs)
    with pytest.raises(UserError, match="--cuda-graphs must be one of"):
        resolve_cuda_graphs("yes", cuda, **common)
    # Compiling is the CUDA default only where the step does not run as graphs.
    assert resolve_compile("auto", cuda) and not resolve_compile("auto", cuda, graphs=True)
    assert not resolve_compile("auto", cpu) and resolve_compile("on", cpu, graphs=True)


def test_graphed_module_dispatch():
    """Calls with the captured shapes go to the graphs, others (and evaluation) to the module itself."""
    net = nn.Linear(4, 2)
    calls = []

    def graphed(x):
        calls.append(x.shape)
        return net(x)

    g = GraphedModule(net, graphed, (torch.zeros(3, 4),))
    assert list(g.parameters()) == []  # the parameters stay net's
    g(torch.randn(3, 4))
    g(torch.randn(5, 4))
    net.eval()
    g(torch.randn(3, 4))
    assert calls == [torch.Size([3, 4])]


def test_training_falls_back_to_eager_when_capture_fails(tmp_path, caplog):
    """--cuda-graphs on a device where capture fails: one logged line, then the eager run, bitwise."""
    from repmlp.engine import DistInfo, LoopOptions, train_loop

    class Loader:
        def __len__(self):
            return 3

        def batches(self, epoch, start=0):
            gen = torch.Generator().manual_seed(epoch)
            for _ in range(start, 3):
                yield torch.randn(4, 5, generator=gen), torch.randint(0, 2, (4,), generator=gen)

    def run(graphs: bool, out):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        opts = LoopOptions(output=out, config={}, lr_at=lambda s: [0.1], epochs=1, cuda_graphs=graphs)

        def step(n, x, y, pos):
            loss = F.cross_entropy(n(x), y)
            return loss, {"loss": float(loss.detach()), "n": 1.0}

        from repmlp.engine import LoopHooks

        result = train_loop(net, opt, Loader(), opts, DistInfo(), hooks=LoopHooks(step=step))
        return net, result

    with caplog.at_level(logging.WARNING, logger="repmlp.engine.loop"):
        graphed, result = run(True, tmp_path / "a")
    assert result.mode == "eager (capture failed)"
    assert "CUDA graphs failed (CUDA graphs need a CUDA device, not cpu)" in caplog.text
    eager, _ = run(False, tmp_path / "b")
    for a, b in zip(graphed.state_dict().values(), eager.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("path", PATHS)
def test_paths_on_cuda_equal_eager(path):
    torch.manual_seed(0)
    deployed = reparameterize_model(
        repmlp.create_model("repmlp_res50_light", **shallow("repmlp_res50_light")).eval()
    )
    model = deployed.cuda().half().to(memory_format=torch.channels_last)
    x = torch.randn(4, 3, 224, 224, device="cuda", dtype=torch.half).contiguous(
        memory_format=torch.channels_last
    )
    with torch.inference_mode():
        ref = model(x).float()
        run = prepare_inference(model, x, path)
        out = run(x).float()
        other = run(x[:2]).float()  # another shape: not the graph's
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(other, ref[:2], rtol=2e-2, atol=2e-2)
    if path.endswith("graph"):
        assert isinstance(run, GraphReplay)


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("dense", [False, True], ids=["plain", "dense-training-form"])
def test_graphed_training_steps_equal_eager_on_cuda(dense: bool):
    """Three SGD steps with the module as CUDA graphs against eager: the same losses and weights, in full
    float32 (TF32 would round the two alike only by chance); also of the dense training form
    (repmlp.engine.forms.training_form), whose capture must copy nothing from the host."""
    from repmlp.engine import graph_module
    from repmlp.engine.forms import DenseLocalPerceptron, training_form
    from repmlp.numerics import full_float32

    torch.manual_seed(0)
    base = repmlp.create_model("repmlp_fmnist_patch2", num_classes=10, in_chans=1).cuda().train()
    x = torch.randn(16, 1, 28, 28, device="cuda")
    y = torch.randint(0, 10, (16,), device="cuda")
    results = []
    for graphs in (False, True):
        torch.manual_seed(1)
        net = copy.deepcopy(base)
        form = training_form(net, dense=True) if dense else net  # the model's own parameters
        assert any(isinstance(m, DenseLocalPerceptron) for m in form.modules()) is dense
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        losses = []
        with full_float32():  # around the capture too: a graph keeps the kernels it was captured with
            step_net = graph_module(form, (x,), None) if graphs else form
            for _ in range(3):
                loss = F.cross_entropy(step_net(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(float(loss))
        results.append((losses, net.state_dict()))
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-4)
    for k, v in results[0][1].items():
        torch.testing.assert_close(results[1][1][k], v, rtol=1e-3, atol=1e-4, msg=k)


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_bench_on_cuda_runs_every_form_alike(precision):
    """repmlp.bench.throughput on CUDA times every form the same way: the plain modules, eager, in the
    precision, channels_last when asked (fp16 here), as each row's path says."""
    from repmlp.bench.throughput import benchmark, in_precision

    model = repmlp.create_model("repmlp_res50_light", **shallow("repmlp_res50_light")).eval()
    models = {"light": in_precision(model, precision, (3, 224, 224)) if precision != "fp32" else model}
    forms = ("deploy",) if precision != "fp32" else ("train", "deploy")
    layout = "channels_last" if precision != "fp32" else "NCHW"
    rows = benchmark(models, (3, 224, 224), 8, device="cuda", warmup=1, repeats=2, forms=forms,
                     channels_last=precision != "fp32")  # fmt: skip
    assert [r.form for r in rows] == list(forms) and all(r.throughput > 0 for r in rows)
    assert all(r.path.startswith(f"eager, {layout}, {precision}, ") for r in rows)


@pytest.mark.cuda
@CUDA
def test_predictor_on_cuda_matches_cpu():
    from repmlp import Predictor

    torch.manual_seed(0)
    model = reparameterize_model(
        repmlp.create_model("repmlp_res50_light", **shallow("repmlp_res50_light")).eval()
    )
    x = torch.randn(3, 3, 224, 224)
    cpu = Predictor(copy.deepcopy(model), device="cpu", top_k=3).predict_batch(x)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # float32 as on the CPU
        gpu = Predictor(model, device="cuda", top_k=3).predict_batch(x)
    for r_gpu, r_cpu in zip(gpu, cpu, strict=True):
        assert [p.probability for p in r_gpu] == pytest.approx([p.probability for p in r_cpu], abs=1e-4)
