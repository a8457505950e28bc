"""A device is parsed once, in harness.schema.devices: its kind and index, or a clear
refusal."""

from __future__ import annotations

import pytest

from harness.schema.axes import AXIS
from harness.schema.devices import (
    CPU,
    CUDA,
    DEVICE_KINDS,
    Device,
    device_kind,
    indexed_device,
    known_device,
)


@pytest.mark.parametrize(
    ("name", "device"),
    [("cpu", Device(CPU)), ("cuda", Device(CUDA)), ("cuda:3", Device(CUDA, 3))],
)
def test_a_device_name_parses_to_its_kind_and_index(name: str, device: Device) -> None:
    assert Device.parse(name) == device
    assert str(Device.parse(name)) == name  # and the name comes back


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("cuda:", "the index after cuda: is a number"),
        ("cuda:-1", "the index after cuda: is a number"),
        ("cuda:1:2", "the index after cuda: is a number"),
        ("cuda:01", "the index after cuda: is a number"),  # it would not round-trip
        ("cpu:0", "cpu takes no index"),
        ("gpu", "expected cpu, cuda or cuda:N"),
        (" cuda", "expected cpu, cuda or cuda:N"),
        ("", "expected cpu, cuda or cuda:N"),
    ],
)
def test_anything_else_is_refused_with_the_forms_a_device_takes(name: str, why: str) -> None:
    with pytest.raises(ValueError, match=f"not a device: {name!r}") as refused:
        Device.parse(name)
    assert why in str(refused.value)


def test_a_bare_cuda_is_the_first_device() -> None:
    assert Device.parse("cuda").ordinal == 0
    assert Device.parse("cuda:2").ordinal == 2


def test_the_kind_of_a_name_is_its_device_kind() -> None:
    assert [device_kind(n) for n in ("cpu", "cuda", "cuda:7")] == ["cpu", "cuda", "cuda"]
    assert set(DEVICE_KINDS) == {CPU, CUDA}
    with pytest.raises(ValueError, match="not a device: 'mps'"):
        device_kind("mps")


def test_a_name_that_need_not_be_a_device_reads_as_none() -> None:
    assert known_device("all") is None
    assert known_device("cuda:1") == Device(CUDA, 1)
    assert indexed_device("cuda:1") == Device(CUDA, 1)
    assert indexed_device("cuda") is None
    assert indexed_device("all") is None


def test_the_device_axis_selects_an_indexed_device_by_its_kind() -> None:
    devices = AXIS["device"]
    assert devices.aliases("cuda:2") == ("cuda:2", "cuda")
    assert devices.aliases("cpu") == ("cpu",)
    assert devices.selects(("cuda",), "cuda:2")
    assert not devices.selects(("cpu",), "cuda:2")
    assert devices.is_request("cuda:3") and devices.is_request("all")
    assert not devices.is_request("cuda:x") and not devices.is_request("cpu:0")
    assert AXIS["dtype"].aliases("float16") == ("float16",)  # an axis without an index
