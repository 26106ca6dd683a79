"""deepseek-flash install-units: the packaged units with ExecStart=/SocketGroup= set, config kept."""
from __future__ import annotations

import json
import os
import sys
from importlib import resources
from pathlib import Path

import pytest
from deepseek_flash.daemon.config import FlashConfig

from deepseek_flash.cli import main
from deepseek_flash.errors import ConfigError
from deepseek_flash.ops import install_units

REPO = Path(__file__).resolve().parents[2]


def packaged(name: str) -> str:
    return resources.files("deepseek_flash").joinpath("data", name).read_text()


def fake_python(bin_dir: Path, with_script: bool) -> Path:
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    python.symlink_to(sys.executable)
    if with_script:
        script = bin_dir / "deepseek-flashd"
        script.write_text("#!/bin/sh\n")
        script.chmod(0o755)
    return python


def install(tmp_path, *extra) -> int:
    return main(["install-units", "--prefix", str(tmp_path / "units"), "--config-dir",
                 str(tmp_path / "etc"), "--socket-group", "root", "--no-reload", *extra])


def test_installs_units_that_differ_from_the_package_only_in_exec_and_group(tmp_path, capsys):
    python = fake_python(tmp_path / "venv" / "bin", with_script=True)
    assert install(tmp_path, "--python", str(python), "--allow-tmp") == 0
    service = (tmp_path / "units" / "deepseek-flash.service").read_text()
    socket_unit = (tmp_path / "units" / "deepseek-flash.socket").read_text()
    want_service = packaged("deepseek-flash.service").replace(
        "ExecStart=/usr/bin/env deepseek-flashd", f"ExecStart={tmp_path}/venv/bin/deepseek-flashd")
    assert service == want_service
    assert socket_unit == packaged("deepseek-flash.socket").replace("SocketGroup=deepseek-flash",
                                                                     "SocketGroup=root")
    assert (tmp_path / "units" / "deepseek-flash.service").stat().st_mode & 0o777 == 0o644
    out = capsys.readouterr().out
    assert f"installed {tmp_path}/units/deepseek-flash.service" in out
    assert "systemctl enable --now deepseek-flash.socket deepseek-flash.service" in out


def test_an_environment_under_tmp_is_refused_naming_private_tmp(tmp_path, capsys):
    # tmp_path lies under /tmp: the service (PrivateTmp=yes) would fail with 203/EXEC.
    assert tmp_path.is_relative_to("/tmp")
    python = fake_python(tmp_path / "venv" / "bin", with_script=True)
    assert install(tmp_path, "--python", str(python)) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}/venv/bin/deepseek-flashd lies under /tmp, which deepseek-flash.service cannot see" in err
    assert "PrivateTmp=yes" in err and "203/EXEC" in err and "--allow-tmp" in err
    assert "[ConfigError, code 500]" in err
    assert not (tmp_path / "units").exists()


def test_allow_tmp_installs_a_private_tmp_drop_in(tmp_path, capsys):
    python = fake_python(tmp_path / "venv" / "bin", with_script=True)
    assert install(tmp_path, "--python", str(python), "--allow-tmp") == 0
    dropin = tmp_path / "units" / "deepseek-flash.service.d" / "private-tmp.conf"
    assert dropin.read_text().splitlines()[1:] == ["[Service]", "PrivateTmp=no"]
    assert f"installed {dropin} (PrivateTmp=no: {tmp_path}/venv/bin/deepseek-flashd is under /tmp)" in (
        capsys.readouterr().out)


def test_an_environment_outside_tmp_gets_no_drop_in(tmp_path, monkeypatch):
    # Resolved and literal paths both count: a link from /var/tmp to a program elsewhere is fine
    # only when neither path is under /tmp.
    monkeypatch.setattr(install_units, "TMP_ROOTS", (Path("/nonexistent-tmp"),))
    python = fake_python(tmp_path / "venv" / "bin", with_script=True)
    assert install(tmp_path, "--python", str(python)) == 0
    assert not (tmp_path / "units" / "deepseek-flash.service.d").exists()
    assert install_units.paths_in_private_tmp(str(python), f"{tmp_path}/venv/bin/deepseek-flashd") == []
    monkeypatch.setattr(install_units, "TMP_ROOTS", (tmp_path,))
    assert install_units.paths_in_private_tmp(str(python), f"{tmp_path}/venv/bin/deepseek-flashd") == [
        tmp_path / "venv" / "bin" / "deepseek-flashd"] * 2


def test_without_a_deepseek_flashd_script_the_unit_runs_the_module(tmp_path):
    python = fake_python(tmp_path / "env" / "bin", with_script=False)
    assert install_units.daemon_command(str(python)) == f"{python} -m deepseek_flash.daemon.app"


def test_daemon_argv_is_this_interpreters_install_not_the_first_on_path(tmp_path, monkeypatch):
    other = fake_python(tmp_path / "other" / "bin", with_script=True)      # first on PATH
    monkeypatch.setenv("PATH", f"{other.parent}:{os.environ['PATH']}")
    mine = fake_python(tmp_path / "mine" / "bin", with_script=True)
    monkeypatch.setattr(install_units.sys, "executable", str(mine))
    assert install_units.daemon_argv() == [str(mine.parent / "deepseek-flashd")]
    bare = fake_python(tmp_path / "bare" / "bin", with_script=False)
    monkeypatch.setattr(install_units.sys, "executable", str(bare))
    assert install_units.daemon_argv() == [str(bare), "-m", "deepseek_flash.daemon.app"]


def test_exec_start_quoting(tmp_path):
    python = fake_python(tmp_path / "my env 100%" / "bin", with_script=True)
    assert install_units.daemon_command(str(python)) == f'"{tmp_path}/my env 100%%/bin/deepseek-flashd"'


def test_bad_python_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="not-a-python-anywhere: not found"):
        install_units.daemon_command("not-a-python-anywhere")


def test_default_config_is_installed_once_and_then_kept(tmp_path, capsys):
    # --allow-tmp: this checkout may itself lie under /tmp (see the PrivateTmp tests below).
    assert install(tmp_path, "--allow-tmp") == 0
    config = tmp_path / "etc" / "flash.json"
    installed = json.loads(config.read_text())
    assert installed["socket_group"] == "root"
    config.write_text('{"prefetch_window": 8}')
    assert install(tmp_path, "--allow-tmp") == 0
    assert config.read_text() == '{"prefetch_window": 8}'
    assert f"kept existing {config}" in capsys.readouterr().out


def test_packaged_config_is_valid_and_matches_the_defaults():
    config = FlashConfig.from_dict(json.loads(packaged("flash.json")))
    defaults = FlashConfig()
    differing = {k for k, v in config.as_dict().items() if defaults[k] != v}
    # The socket group is named so the .socket unit and the daemon agree on it; store_roots
    # spells out the root default (it depends on who runs the test).
    assert differing <= {"socket_group", "store_roots"}
    assert config.socket_group == "deepseek-flash"
    assert config.store_roots == ["/var/lib/deepseek-flash/models"]


def test_repository_units_are_the_packaged_files():
    # systemd/ and etc/ are links to the single source in deepseek_flash/data/.
    for link, name in [("systemd/deepseek-flash.service", "deepseek-flash.service"),
                       ("systemd/deepseek-flash.socket", "deepseek-flash.socket"),
                       ("systemd/deepseek-flash-serve@.service", "deepseek-flash-serve@.service"),
                       ("etc/flash.json", "flash.json")]:
        path = REPO / link
        assert path.is_symlink() and os.path.samefile(path, REPO / "deepseek_flash" / "data" / name)


def test_service_unit_has_the_required_settings():
    lines = set(packaged("deepseek-flash.service").splitlines())
    for setting in ["Type=notify", "NotifyAccess=main", "ExecReload=/bin/kill -HUP $MAINPID",
                    "WatchdogSec=30", "RuntimeDirectory=deepseek_flash", "RuntimeDirectoryPreserve=yes",
                    "ConfigurationDirectory=deepseek-flash", "StateDirectory=deepseek-flash",
                    "Restart=on-failure", "RestartPreventExitStatus=2", "LimitMEMLOCK=infinity", "ProtectSystem=strict",
                    "ProtectHome=read-only", "PrivateTmp=yes", "NoNewPrivileges=yes",
                    "RestrictAddressFamilies=AF_UNIX AF_NETLINK", "DevicePolicy=closed",
                    "DeviceAllow=char-nvidia-frontend rw", "DeviceAllow=char-nvidia-uvm rw",
                    "DeviceAllow=/dev/nvidiactl rw", "DeviceAllow=block-* r",
                    "SystemCallFilter=@system-service", "Requires=deepseek-flash.socket"]:
        assert setting in lines, setting
    socket_lines = set(packaged("deepseek-flash.socket").splitlines())
    for setting in ["ListenStream=/run/deepseek_flash/control.sock", "SocketMode=0660",
                    "SocketGroup=deepseek-flash", "WantedBy=sockets.target"]:
        assert setting in socket_lines, setting


def test_installs_the_serve_template_unit_running_this_environments_cli(tmp_path):
    python = fake_python(tmp_path / "venv" / "bin", with_script=True)
    (tmp_path / "venv" / "bin" / "deepseek-flash").write_text("#!/bin/sh\n")
    (tmp_path / "venv" / "bin" / "deepseek-flash").chmod(0o755)
    assert install(tmp_path, "--python", str(python), "--allow-tmp") == 0
    serve = (tmp_path / "units" / "deepseek-flash-serve@.service").read_text()
    # The environment lies under /tmp: the server unit gets the PrivateTmp=no drop-in too.
    assert "PrivateTmp=no" in (tmp_path / "units" / "deepseek-flash-serve@.service.d" / "private-tmp.conf").read_text()
    assert serve == packaged("deepseek-flash-serve@.service").replace(
        "ExecStart=/usr/bin/env deepseek-flash serve %I $SERVE_ARGS",
        f"ExecStart={tmp_path}/venv/bin/deepseek-flash serve %I $SERVE_ARGS")
    bare = fake_python(tmp_path / "bare" / "bin", with_script=False)
    assert install_units.cli_command(str(bare)) == f"{bare} -m deepseek_flash"


def test_serve_unit_is_hardened_and_ordered_after_the_daemon_which_stays_af_unix_only():
    serve = set(packaged("deepseek-flash-serve@.service").splitlines())
    for setting in ["Type=notify", "NotifyAccess=main", "Wants=deepseek-flash.service",
                    "After=deepseek-flash.service deepseek-flash.socket network.target",
                    "EnvironmentFile=-/etc/deepseek-flash/serve-%i.env", "ProtectSystem=strict",
                    "ProtectHome=read-only", "PrivateTmp=yes", "NoNewPrivileges=yes", "DevicePolicy=closed",
                    "DeviceAllow=char-nvidia-frontend rw", "DeviceAllow=char-nvidia-uvm rw",
                    "SystemCallFilter=@system-service", "CapabilityBoundingSet=", "LimitMEMLOCK=infinity",
                    "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6", "Restart=on-failure"]:
        assert setting in serve, setting
    assert not any(line.startswith("DeviceAllow=block") for line in serve)
    daemon = packaged("deepseek-flash.service")
    assert "RestrictAddressFamilies=AF_UNIX AF_NETLINK" in daemon.splitlines()
    assert "AF_INET" not in daemon
