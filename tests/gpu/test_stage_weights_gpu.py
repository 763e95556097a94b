"""Stage weights read straight to a GPU, and tensors between two GPU processes over NCCL while
headers stay on gloo. Skipped without CUDA (the NCCL test under two GPUs)."""

import io

import pytest
import torch
import torch.multiprocessing as mp

import fxpipe
from fxpipe.runtime.schedules import Phase

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


def test_a_plan_without_weights_reads_each_stage_onto_its_gpu(tmp_path):
    from test_stage_weights import checkpoint, example, planned_on_meta
    model, ids = example()
    planned_on_meta(model, ids).save(tmp_path / "plan")
    plan = fxpipe.load_plan(tmp_path / "plan", model=model, devices=["cuda:0", "cuda:0"],
                            weights=checkpoint(model, tmp_path / "model.safetensors"))
    assert all(t.device.type == "cuda" for stage in plan.stages
               for t in [*stage.module.parameters(), *stage.module.buffers()])
    with torch.no_grad():
        torch.testing.assert_close(fxpipe.Pipeline(plan)(ids.cuda()).cpu(), model(ids))


def _nccl_side(me, init, results):
    import torch.distributed as dist

    from fxpipe.distributed import DistributedTransport
    dist.init_process_group("gloo", init_method=init, rank=me, world_size=2)
    device = torch.device("cuda", me)
    torch.cuda.set_device(device)
    tensors = dist.new_group(backend="nccl")
    transport = DistributedTransport(me, device, timeout=30, peers=[0, 1], tensor_group=tensors)
    got = []
    try:
        for m in range(3):
            if me == 0:
                transport.send(Phase.FORWARD, 0, 1, m, {"x": torch.full((4,), float(m),
                                                                        device=device)})
            else:
                (x,) = transport.receive(Phase.FORWARD, 0, 1, m).values()
                got.append((str(x.device), x.cpu()))
        transport.finish_step()
    finally:
        buffer = io.BytesIO()
        torch.save(got, buffer)
        results.put((me, buffer.getvalue()))
        dist.destroy_process_group()


@two_gpus
def test_tensors_go_from_gpu_to_gpu_over_nccl_and_headers_over_gloo(tmp_path):
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    processes = [context.Process(target=_nccl_side,
                                 args=(me, f"file://{tmp_path / 'init'}", results))
                 for me in (0, 1)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(120)
    assert [process.exitcode for process in processes] == [0, 0]
    got = dict(results.get() for _ in processes)
    received = torch.load(io.BytesIO(got[1]), weights_only=False)
    assert [device for device, _ in received] == ["cuda:1"] * 3
    for m, (_, x) in enumerate(received):
        torch.testing.assert_close(x, torch.full((4,), float(m)))
