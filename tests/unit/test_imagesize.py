"""The size budget check and the layer listing of builder/imagesize.py (the docker CLI replaced by a script
that prints what `docker history` prints; the real daemon's answer is held by tests/integration/test_release.py)."""
import stat

import pytest

from builder.dockerclient import DockerCli
from builder.errors import BuildError
from builder.imagesize import Layer, check_budget, image_layers


def test_under_or_at_the_budget_passes_and_no_budget_never_fails():
    check_budget("a:cpu", 1_000_000_000, 1.0, ())
    check_budget("a:cpu", 10**15, None, ())


def test_over_the_budget_names_the_size_the_budget_and_the_largest_layers():
    layers = (Layer(100, "ADD rootfs"), Layer(900_000_000, "RUN pip install torch"), Layer(5, "COPY x"),
              Layer(200_000_000, "COPY engine"), Layer(50, "ENV A=1"))
    with pytest.raises(BuildError) as caught:
        check_budget("a:cpu", 1_000_000_001, 1.0, layers)
    assert caught.value.exit_code == 4
    assert caught.value.message == (
        "a:cpu: the image is 1.00 GB, over its flavour's size budget of 1 GB (matrix.yaml size_budget_gb); "
        "largest layers: 0.90 GB: RUN pip install torch; 0.20 GB: COPY engine; 0.00 GB: ADD rootfs")


def test_the_message_clips_each_layers_step_to_80_characters():
    step = "RUN " + "y" * 100
    with pytest.raises(BuildError) as caught:
        check_budget("a:cpu", 3 * 10**9, 2.0, (Layer(2 * 10**9, step),))
    assert caught.value.message.endswith(f"largest layers: 2.00 GB: {step[:80]}")


def test_image_layers_reads_docker_history_bottom_first_and_skips_empty_layers(tmp_path):
    fake = tmp_path / "docker"
    fake.write_text("#!/bin/sh\n"
                    "echo \"$@\" > \"$(dirname \"$0\")/argv\"\n"
                    "printf '0\\tCMD [\"serve\"]\\n400\\tCOPY  engine\\t/opt\\n'\n"
                    "printf '7\\tRUN pip   install x\\nabc\\tbroken\\n1\\tCOPY one byte\\n'\n"
                    "printf '9\\tRUN %0250d\\n' 0\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    cli = DockerCli(path=str(fake), version="20.10", buildkit="builtin")
    assert image_layers("sha256:abc", docker=cli) == (
        Layer(9, ("RUN " + "0" * 250)[:200]), Layer(1, "COPY one byte"), Layer(7, "RUN pip install x"),
        Layer(400, "COPY engine /opt"))
    assert (tmp_path / "argv").read_text().rstrip("\n").split(" ") == [
        "history", "--no-trunc", "--human=false", "--format", "{{.Size}}\t{{.CreatedBy}}", "sha256:abc"]
