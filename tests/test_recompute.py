"""Re-materialisation: a stage keeps only its inputs and recomputes its activations in the
backward; the step's loss, gradients and model state equal those without it."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe


class Net(nn.Module):
    """Dropout, BatchNorm and a skip connection across stages."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 8)
        self.norm = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        h = torch.relu(self.a(x))
        g = self.drop(torch.relu(self.norm(self.b(h)))) + h
        return self.c(g)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_recomputing_gives_the_same_step_dropout_and_batchnorm_included(schedule):
    torch.manual_seed(0)
    model, x, target = Net().train(), torch.randn(16, 8), torch.randn(16, 8)
    twin = copy.deepcopy(model)
    runs = {}
    for recompute, m in (("never", model), ("always", twin)):
        pipe = fxpipe.compile(m, ["cpu"] * 3, (x,), chunks=4, schedule=schedule,
                              recompute=recompute)
        assert pipe.plan.recompute == recompute
        torch.manual_seed(1)
        loss = pipe.train_step(x, target, F.mse_loss)
        runs[recompute] = (loss, {n: p.grad for n, p in m.named_parameters()},
                           {n: b.clone() for n, b in m.named_buffers()})
    (loss, grads, buffers), (loss2, grads2, buffers2) = runs["never"], runs["always"]
    torch.testing.assert_close(loss2, loss)
    for name in grads:
        torch.testing.assert_close(grads2[name], grads[name], msg=name)
    for name in buffers:     # BatchNorm's running statistics updated once per micro-batch
        torch.testing.assert_close(buffers2[name], buffers[name], msg=name)
    assert buffers["norm.num_batches_tracked"].item() == 4


def test_a_recomputing_stage_keeps_only_its_inputs_until_its_backward():
    from fxpipe.runtime import StageExecutor
    from fxpipe.passes.codegen import split_stages
    import torch.fx as fx

    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64)))
    (stage,) = split_stages(gm, {n.name: 0 for n in gm.graph.nodes
                                 if n.op not in ("placeholder", "output")}, ["cpu"])
    x = torch.randn(8, 4)
    kept = {}
    for recompute in (False, True):
        saved = []
        executor = StageExecutor(stage, backward_for=[0], recompute=recompute)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                      lambda t: t):
            out = executor.forward(0, {stage.inputs[0]: x})
        kept[recompute] = len(saved)
        (name,) = stage.outputs
        executor.backward(0, [{name: [torch.ones_like(out[name])]}])
    assert kept[True] == 0 < kept[False]


def test_recompute_is_checked():
    with pytest.raises(fxpipe.FxpipeError, match="recompute='sometimes'"):
        fxpipe.compile(Net(), ["cpu"], (torch.randn(4, 8),), recompute="sometimes")


def test_the_plan_shows_each_stages_training_memory_kept_and_recomputed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).train()
    pipe = fxpipe.compile(model, ["cpu"] * 2, (torch.randn(32, 64),), chunks=4,
                          schedule="gpipe", optimizer="adam")
    plan = pipe.plan
    assert any(plan.stage_saved_bytes)
    for s, cost in enumerate(plan.partition.stages):
        state = 4 * plan.stage_param_bytes[s]       # weights, gradients, Adam's two moments
        saved, received = plan.stage_saved_bytes[s], cost.received_bytes
        # GPipe keeps every micro-batch in flight at each stage.
        assert cost.memory_kept_bytes == state + 4 * (saved + received)
        assert cost.memory_recomputing_bytes == state + 4 * received + saved
        assert cost.memory_bytes == cost.memory_kept_bytes and not cost.recompute
    assert "memory in training" in str(plan)
    inference = fxpipe.compile(model.eval(), ["cpu"] * 2, (torch.randn(32, 64),))
    assert not any(inference.plan.stage_saved_bytes)
    assert "memory in training" not in str(inference.plan)
