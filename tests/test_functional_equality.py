"""In-place writes as the user's model spells them: the pipeline computes what the model does, or
compile refuses by name; and errors that show their numbers."""

import pytest
import torch
from torch import nn

import fxpipe


# --- memory errors show their numbers ------------------------------------------------------------

def chain_of_linears(depth=4, width=16):
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def test_a_node_too_big_for_a_tiny_device_reads_in_bytes_it_can_show():
    devices = [fxpipe.DeviceSpec("cpu", memory_bytes=1000)] * 2
    with pytest.raises(fxpipe.PartitionError,
                       match=r"node '_0' alone needs 1\.\d KB, more than any device has "
                             r"\(at most 1\.0 KB\)"):
        fxpipe.compile(chain_of_linears(), devices, (torch.randn(8, 16),))


def test_stages_too_big_for_tiny_devices_read_in_kilobytes():
    devices = [fxpipe.DeviceSpec("cpu", memory_bytes=2000)] * 2
    with pytest.raises(fxpipe.PartitionError,
                       match=r"needs \d+\.\d KB in all \(4\.0 KB available\): stage 0 on cpu "
                             r"needs \d\.\d KB but has 2\.0 KB"):
        fxpipe.compile(chain_of_linears(), devices, (torch.randn(8, 16),))
