"""The C++ toolchain image (issue 38, first part): a root made only of pinned Debian packages, each
checked against its sha256, reproducible in its hash, with a precompiled <bits/stdc++.h> per preset
that a compile in a jail seeing only the toolchain and the source really uses."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from codeenv.errors import ImageError
from codeenv.sandbox.jail import nsjail_binary, without_linker_notices
from codeenv.sandbox.toolchain import Toolchain, ToolchainSpec, ensure_toolchain, find_toolchain_spec, is_toolchain
from codeenv.settings import SandboxSettings
from tests.conftest import need_root

NAME = "cpp-gcc12"
PROGRAM = "#include <bits/stdc++.h>\nint main() { std::vector<long long> v(10); std::iota(v.begin(), v.end(), 1);\n" \
          "  std::cout << std::accumulate(v.begin(), v.end(), 0LL) << '\\n'; }\n"


@pytest.mark.unit
def test_the_declaration_pins_every_package_and_names_its_presets() -> None:
    spec, _ = find_toolchain_spec(NAME)
    assert is_toolchain(NAME) and not is_toolchain("python-math")
    assert {p.name for p in spec.packages} >= {"g++-12", "libstdc++-12-dev", "binutils", "libc6-dev"}
    assert len({p.name for p in spec.packages}) == len(spec.packages)
    assert set(spec.presets) == {"codeforces", "ioi", "plain"}
    toolchain = Toolchain(Path("/nonexistent"), "0" * 64, spec)
    assert toolchain.preset_flags("codeforces") == ["-DONLINE_JUDGE", "-O2", "-pipe", "-s", "-std=c++17",
                                                    "-I/usr/lib/codeenv-pch/codeforces"]
    assert toolchain.preset_flags("ioi", "c++20") == ["-DEVAL", "-O2", "-pipe", "-s", "-std=c++20"]  # no PCH
    with pytest.raises(ImageError, match="unknown preset"):
        toolchain.preset_flags("icpc")


@pytest.fixture(scope="module")
def toolchain() -> Toolchain:
    need_root("the toolchain's build (chroot) and its jail")
    if shutil.which("apt-get") is None:
        pytest.skip("no apt-get: the toolchain is built from Debian's packages")
    return ensure_toolchain(NAME, SandboxSettings().images_dir)


def jailed(toolchain: Toolchain, work: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """`argv` in nsjail: the toolchain's root read-only as /, `work` as /src, a fresh /tmp, no /proc."""
    cmd = [str(nsjail_binary(SandboxSettings())), "-Mo", "--really_quiet", "--chroot", str(toolchain.root),
           "--user", "65534", "--group", "65534", "--disable_proc", "--env", "PATH=/usr/bin:/bin",
           "--tmpfsmount", "/tmp", "--bindmount", f"{work}:/src", "--cwd", "/tmp", "--rlimit_as", "2048",
           "--time_limit", "60", "--", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.fixture
def work() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="codeenv-cpp-") as tmp:
        os.chmod(tmp, 0o777)  # the jail's user writes its binary there
        (Path(tmp) / "a.cpp").write_text(PROGRAM)
        yield Path(tmp)


@pytest.mark.unit
def test_the_compilers_diagnostics_are_kept_without_nsjails_own_linker_notices() -> None:
    nsjail = Path("/opt/venv/bin/nsjail")
    notice = (f"{nsjail}: /lib/x86_64-linux-gnu/libnl-3.so.200: no version information available "
              f"(required by {nsjail})\n")
    said = "/work/solution.cpp:1:1: error: 'a' does not name a type\n"
    assert without_linker_notices(notice * 2 + said, nsjail) == said
    assert without_linker_notices(notice * 2, nsjail) == ""
    # the program's own text is never taken for a notice, even where it says the same words
    echoed = said + notice
    assert without_linker_notices(echoed, nsjail) == echoed
    assert without_linker_notices("no version information available\n", nsjail) == "no version information available\n"


@pytest.mark.jail
@pytest.mark.parametrize("preset", ["codeforces", "ioi", "plain"])
def test_each_preset_compiles_with_its_precompiled_header_in_a_jail(toolchain: Toolchain, work: Path,
                                                                    preset: str) -> None:
    compiler = toolchain.spec.compiler
    done = jailed(toolchain, work, compiler, *toolchain.preset_flags(preset), "-Winvalid-pch", "-Werror", "-H",
                  "-o", "/src/a.out", "/src/a.cpp")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"! /usr/lib/codeenv-pch/{preset}/bits/stdc++.h.gch" in done.stderr  # -H: "!" = the PCH was used
    ran = jailed(toolchain, work, "/src/a.out")
    assert ran.returncode == 0 and ran.stdout == "55\n", ran.stderr
    other = jailed(toolchain, work, compiler, *toolchain.preset_flags(preset, "c++20"), "-H", "-o", "/src/b.out",
                   "/src/a.cpp")
    assert other.returncode == 0 and ".gch" not in other.stderr, other.stderr[-2000:]  # another std: no PCH


@pytest.mark.jail
def test_the_root_holds_only_its_packages_and_its_hash_is_reproducible(toolchain: Toolchain) -> None:
    root = toolchain.root
    assert (root / "usr/bin/g++-12").is_file() and (root / "lib64/ld-linux-x86-64.so.2").exists()
    assert not (root / "usr/bin/python3").exists() and not (root / "bin/sh").exists()  # not the host's /usr
    with tempfile.TemporaryDirectory(dir=toolchain.path.parent) as tmp:
        (Path(tmp) / ".debs").symlink_to(toolchain.path.parent / ".debs")  # the downloads, not the build
        again = ensure_toolchain(NAME, Path(tmp))
        assert again.content_hash == toolchain.content_hash and again.path != toolchain.path


@pytest.mark.jail
def test_a_package_that_is_not_its_pinned_sha256_is_refused(toolchain: Toolchain, tmp_path: Path) -> None:
    spec, _ = find_toolchain_spec(NAME)
    forged = spec.model_copy(update={"name": "cpp-forged", "packages": [
        p.model_copy(update={"sha256": "0" * 64}) if p.name == "libjansson4" else p for p in spec.packages]})
    text = tomlish(forged)
    declaration = tmp_path / "forged" / "toolchain.toml"
    declaration.parent.mkdir()
    declaration.write_text(text)
    cache = tmp_path / "images" / ".debs"
    cache.mkdir(parents=True)
    for deb in (toolchain.path.parent / ".debs").glob("*.deb"):  # links: the refused one is unlinked here only
        os.link(deb, cache / deb.name)
    images = cache.parent
    with pytest.raises(ImageError, match="pinned sha256"):
        ensure_toolchain(str(declaration), images)
    assert not (images / "cpp-forged").exists()


def tomlish(spec: ToolchainSpec) -> str:
    """A declaration's TOML (the few shapes a toolchain.toml has)."""
    lines = [f'name = "{spec.name}"', f'compiler = "{spec.compiler}"']
    for name, preset in spec.presets.items():
        lines += [f"[presets.{name}]", f"flags = {preset.flags!r}".replace("'", '"'), f'std = "{preset.std}"']
    for p in spec.packages:
        lines += ["[[packages]]", f'name = "{p.name}"', f'version = "{p.version}"', f'sha256 = "{p.sha256}"']
    return "\n".join(lines) + "\n"
