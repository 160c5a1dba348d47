"""Cluster: sizes, rank placement, topology levels, and the published collective figures."""

from __future__ import annotations

import pytest

from autopar import Cluster, ProfileError
from autopar.hardware import load_profile

GiB = 2**30


def test_world_size_and_nodes():
    cluster = Cluster.from_profile("dgx_h100", num_nodes=4)
    assert cluster.world_size == 32
    assert cluster.node_of(0) == 0 and cluster.node_of(31) == 3
    assert "world size 32" in cluster.as_text() and "nvlink" in cluster.as_text()


def test_level_of_a_group():
    cluster = Cluster.from_profile("dgx_h100", num_nodes=2)
    inner, outer = cluster.profile.levels[0].name, cluster.profile.levels[-1].name
    assert cluster.level_of([0, 1, 2, 3]) == inner
    assert cluster.level_of(range(8)) == inner
    assert cluster.level_of([0, 8]) == outer
    assert cluster.level_of(range(16)) == outer
    group = cluster.comm_group(range(16))
    assert group.ranks_per_domain == (8, 16)


def test_partial_nodes_keep_devices_on_their_own_node():
    cluster = Cluster.from_profile("dgx_h100", num_nodes=2, devices_per_node=4)
    assert cluster.world_size == 8
    inner = cluster.profile.levels[0].name
    assert cluster.level_of([0, 3]) == inner
    assert cluster.level_of([3, 4]) != inner  # rank 4 is the first device of node 1


def test_world_size_the_profile_cannot_form():
    with pytest.raises(ProfileError) as err:
        Cluster.from_profile("dgx_h100", num_devices=12)
    message = str(err.value)
    assert "cannot form a world of 12 devices from nodes of 8" in message
    assert "8 or 16" in message
    assert Cluster.from_profile("dgx_h100", num_devices=16).num_nodes == 2
    assert Cluster.from_profile("dgx_h100", num_devices=4).world_size == 4
    with pytest.raises(ProfileError, match="num_nodes must be an integer >= 1, got 0"):
        Cluster.from_profile("dgx_h100", num_nodes=0)


def test_tpu_slice():
    cluster = Cluster.from_profile("tpu_v4", slice_shape=(4, 4, 8))
    assert cluster.world_size == 128
    assert cluster.torus_coords(1) == (0, 0, 1)
    assert cluster.torus_coords(8) == (0, 1, 0)
    assert cluster.level_of([0, 1]) == "ici"
    # A whole dim of size >= 4 closes into a ring; a part of it is a line.
    whole = cluster.comm_group(range(8))
    assert whole.dim_sizes == (8,) and whole.wraparound == (True,)
    part = cluster.comm_group(range(4))
    assert part.wraparound == (False,)
    with pytest.raises(ProfileError, match="give slice_shape with 3 dims"):
        Cluster.from_profile("tpu_v4")
    with pytest.raises(ProfileError, match="no larger than"):
        Cluster.from_profile("tpu_v4", slice_shape=(4, 4, 64))


def test_h100_in_node_all_reduce_matches_nccl_tests():
    # nccl-tests all_reduce_perf, 8 GiB, 8x H100 in one node: busbw 480.16 GB/s
    # (shared/data/hardware_specs.csv notes, NVIDIA/dgxc-benchmarking).
    cluster = Cluster.from_profile("dgx_h100")
    est = cluster.collective_time("all_reduce", 8 * GiB, range(8))
    assert est.bus_bandwidth_bytes_per_s == pytest.approx(480e9, rel=0.10), est.as_text()


def test_h100_cross_node_all_reduce_matches_46_to_48_gb_per_nic():
    # NCCL maintainer (NVIDIA/nccl-tests#290): 46-48 GB/s busbw per 400 Gb/s NDR NIC across
    # nodes; a DGX H100 has one NIC per GPU, so 8 NICs carry a 16-GPU ring.
    cluster = Cluster.from_profile("dgx_h100", num_nodes=2)
    est = cluster.collective_time("all_reduce", 8 * GiB, range(16))
    per_nic = est.bus_bandwidth_bytes_per_s / 8
    assert 46e9 * 0.9 <= per_nic <= 48e9 * 1.1, est.as_text()


def test_comm_group_rejects_bad_ranks():
    cluster = Cluster.from_profile("dgx_h100")
    with pytest.raises(ValueError, match="rank 8 outside the cluster's world of 8"):
        cluster.comm_group([0, 8])


def test_ranks_beyond_the_compute_slots_time_share_the_device():
    """local_cpu: 2 cores (compute_slots = 2); 4 ranks get half the rates each, 2 all of them,
    and GPU profiles (no compute_slots) are untouched."""
    two = Cluster.from_profile("local_cpu", num_devices=2)
    four = Cluster.from_profile("local_cpu", num_devices=4)
    assert two.profile.compute_slots == 2
    assert two.profile.device == load_profile("local_cpu").device
    d2, d4 = two.profile.device, four.profile.device
    assert d4.peak("fp32") == pytest.approx(d2.peak("fp32") / 2)
    assert d4.memory_bandwidth_bytes_per_s == pytest.approx(d2.memory_bandwidth_bytes_per_s / 2)
    assert d4.launch_overhead_s == pytest.approx(2 * d2.launch_overhead_s)
    assert d4.memory_bytes == d2.memory_bytes
    gpu = Cluster.from_profile("dgx_h100")
    assert gpu.profile.compute_slots == 0 and gpu.profile.device == load_profile("dgx_h100").device
