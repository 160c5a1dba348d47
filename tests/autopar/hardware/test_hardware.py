"""Shipped hardware profiles: they load, match the published specs, and bad files are refused."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest

from autopar import ProfileError, load_profile, shipped_profile_names

SPECS = Path(__file__).resolve().parents[3] / "data" / "hardware_specs.csv"
REQUIRED = {
    "dgx_v100",
    "dgx2_v100",
    "dgx_a100_40g",
    "dgx_a100_80g",
    "dgx_h100",
    "h100_grand_teton",
    "dgx_h200",
    "hgx_h800",
    "dgx_b200",
    "gb200_nvl72",
    "gb300_nvl72",
    "mi300x_8x",
    "tpu_v4",
    "tpu_v5e",
    "tpu_v5p",
    "local_cpu",
}


def test_every_required_profile_ships_and_loads():
    assert set(shipped_profile_names()) >= REQUIRED
    for name in shipped_profile_names():
        profile = load_profile(name)
        assert profile.name == name
        assert profile.device.peak("bf16") > 0 and profile.device.memory_bytes > 0
        assert all(src.strip() for src in profile.sources.values()), name
        assert name in profile.as_text()


def _spec_rows() -> dict[str, dict[str, str]]:
    with SPECS.open() as f:  # ships in the repository (data/README.md)
        return {row["device"]: row for row in csv.DictReader(f)}


def _first_number(cell: str) -> float | None:
    m = re.match(r"\s*([0-9.]+)", cell or "")
    return float(m.group(1)) if m else None


# profiles of a spec row's device on another system's network than the row's
OTHER_NETWORK = {"a100_40g_100gbe": "100 Gb/s Ethernet: the Mist artifact's cloud testbed"}


def test_profiles_match_published_hardware_specs():
    rows = _spec_rows()
    checked = 0
    for name in shipped_profile_names():
        profile = load_profile(name)
        if not profile.spec_device:
            continue
        row = rows[profile.spec_device]
        dev = profile.device
        expect = {
            "peak_bf16_tflops_dense": ("bf16", 1e12),
            "peak_fp8_tflops_dense": ("fp8", 1e12),
            "peak_fp32_tflops": ("fp32", 1e12),
        }
        for column, (dtype, scale) in expect.items():
            value = _first_number(row[column])
            if value is not None:
                assert dev.peak_flops_per_s[dtype] == pytest.approx(value * scale, rel=0.01), (
                    name,
                    column,
                )
                checked += 1
        hbm = _first_number(row["hbm_gb"])
        if hbm is not None and " or " not in row["hbm_gb"]:
            as_gib = dev.memory_bytes / 2**30
            if profile.kind == "gpu":  # what the allocator can take: below the HBM's GiB
                assert hbm * 0.95 <= as_gib <= hbm * 0.99, (name, hbm, as_gib)
            else:  # the source's figure, in GB or GiB
                as_gb = dev.memory_bytes / 1e9
                assert min(abs(as_gb / hbm - 1), abs(as_gib / hbm - 1)) < 0.01, (name, hbm)
            checked += 1
        bandwidth = _first_number(row["hbm_tbps"])
        if bandwidth is not None:
            assert dev.memory_bandwidth_bytes_per_s == pytest.approx(bandwidth * 1e12, rel=0.01)
            checked += 1
        intra = _first_number(row["intra_node_gbps_per_gpu_unidirectional"])
        if intra is not None and profile.levels:
            assert profile.levels[0].bandwidth_bytes_per_s == pytest.approx(intra * 1e9, rel=0.01)
            checked += 1
        inter = _first_number(row["inter_node_gbps_per_gpu"])
        if inter is not None and len(profile.levels) > 1 and name not in OTHER_NETWORK:
            outer = profile.levels[-1].bandwidth_bytes_per_s
            assert outer == pytest.approx(inter * 1e9 / 8, rel=0.01), name
            checked += 1
    assert checked >= 40


@pytest.fixture
def h100_text() -> str:
    return (Path(load_profile("dgx_h100").path)).read_text()


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "broken.toml"
    path.write_text(text)
    return path


def test_missing_bandwidth_names_file_and_field(tmp_path, h100_text):
    text = re.sub(r"(?m)^bandwidth_bytes_per_s\s*=.*\n", "", h100_text, count=1)
    path = _write(tmp_path, text)
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    assert str(path) in str(err.value)
    assert "topology.levels[0].bandwidth_bytes_per_s: missing" in str(err.value)


def test_negative_bandwidth_names_the_value(tmp_path, h100_text):
    text = re.sub(
        r"(?m)^bandwidth_bytes_per_s\s*=.*$", "bandwidth_bytes_per_s = -5e9", h100_text, count=1
    )
    with pytest.raises(ProfileError, match=r"bandwidth_bytes_per_s: must be > 0, got -5000000000"):
        load_profile(_write(tmp_path, text))


def test_unknown_dtype_is_refused(tmp_path, h100_text):
    text = re.sub(
        r"(?m)^\[device\.peak_flops_per_s\]\n",
        "[device.peak_flops_per_s]\nint3 = 1e15\n",
        h100_text,
    )
    with pytest.raises(ProfileError, match=r"peak_flops_per_s.int3: unknown dtype 'int3'; known"):
        load_profile(_write(tmp_path, text))


def test_an_fp32_matmul_curve_is_optional_and_checked_like_the_others(tmp_path, h100_text):
    """Without `[device.efficiency.matmul_fp32]` fp32 matmuls take the matmul curve; with one,
    its max must be a fraction and its source is kept."""
    table = re.search(r"(?ms)^\[device\.efficiency\.matmul_fp32\]\n.*?(?=^\[)", h100_text)
    assert table, "dgx_h100 ships an fp32 curve"
    without = load_profile(_write(tmp_path, h100_text.replace(table.group(0), ""))).device
    assert without.matmul_fp32 is None and without.matmul_curve("fp32") is without.matmul
    assert "h200_kernels" in load_profile("dgx_h100").sources["device.efficiency.matmul_fp32"]
    broken = table.group(0).replace("max = 0.66", "max = 1.5")
    with pytest.raises(ProfileError, match=r"efficiency.matmul_fp32.max: must be in \(0, 1\]"):
        load_profile(_write(tmp_path, h100_text.replace(table.group(0), broken)))


def test_malformed_toml_is_refused(tmp_path, h100_text):
    with pytest.raises(ProfileError, match="not valid TOML"):
        load_profile(_write(tmp_path, h100_text[: len(h100_text) // 2] + "\n[[["))


def test_unknown_profile_name_lists_the_shipped_ones():
    with pytest.raises(ProfileError) as err:
        load_profile("dgx_h1000")
    message = str(err.value)
    assert "unknown hardware profile 'dgx_h1000'" in message
    for name in ("dgx_h100", "tpu_v5p", "local_cpu"):
        assert name in message


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(ProfileError, match="no such hardware profile file"):
        load_profile(tmp_path / "nope.toml")


_NUMBER_LINE = re.compile(r"^(\s*)([A-Za-z_][\w-]*)(\s*=\s*)([-+0-9.e_]+)(\s*(#.*)?)$")


def _number_lines(name: str) -> list[tuple[str, int]]:
    from importlib import resources

    text = (resources.files("hardware_profiles") / f"{name}.toml").read_text()
    priced = text.split("\n[measured]")[0]  # the raw measurements after it are not read
    return [(name, i) for i, line in enumerate(priced.splitlines()) if _NUMBER_LINE.match(line)]


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
@pytest.mark.parametrize(
    ("name", "line"),
    _number_lines("dgx_h100") + _number_lines("local_cpu") + _number_lines("tpu_v5p"),
)
def test_every_number_of_a_profile_must_be_finite(name, line, value):
    """Each number of a shipped profile, set to inf, -inf or nan, is refused by name
    (TOML spells them; a profile with one gave infinite step times or fit everything)."""
    from importlib import resources

    from autopar.hardware import profile_from_text

    lines = (resources.files("hardware_profiles") / f"{name}.toml").read_text().splitlines()
    match = _NUMBER_LINE.match(lines[line])
    lines[line] = f"{match[1]}{match[2]}{match[3]}{value}{match[5]}"
    with pytest.raises(ProfileError) as err:
        profile_from_text("\n".join(lines), f"{name}-edited")
    message = str(err.value)
    assert f"{name}-edited: field " in message and match[2] in message, message
    assert value.lstrip("-") in message, message
