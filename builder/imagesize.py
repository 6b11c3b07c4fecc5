"""An image's size against its flavour's budget (matrix.yaml `size_budget_gb`), and the layers it is made of,
as the release report shows them: a release does not publish an image that outgrew its budget."""
from __future__ import annotations

from dataclasses import dataclass

from .dockerclient import DockerCli, run_docker
from .errors import BuildError

GB = 1e9  # docker reports sizes in SI units; so do the budgets


@dataclass(frozen=True)
class Layer:
    size_bytes: int
    created_by: str  # the Dockerfile step, clipped


def image_layers(image_id: str, docker: DockerCli | None = None) -> tuple[Layer, ...]:
    """The layers of IMAGE_ID that hold files, bottom first (`docker history`, which lists them top first)."""
    out = run_docker(["history", "--no-trunc", "--human=false", "--format", "{{.Size}}\t{{.CreatedBy}}", image_id],
                     docker=docker, timeout=60).stdout
    layers = []
    for line in reversed(out.splitlines()):
        size, _, created_by = line.partition("\t")
        if size.isdigit() and int(size) > 0:
            layers.append(Layer(int(size), " ".join(created_by.split())[:200]))
    return tuple(layers)


def check_budget(variant_id: str, size_bytes: int, budget_gb: float | None, layers: tuple[Layer, ...]) -> None:
    """Raise BuildError when the image is larger than its budget, naming its largest layers."""
    if budget_gb is None or size_bytes <= budget_gb * GB:
        return
    largest = sorted(layers, key=lambda layer: -layer.size_bytes)[:3]
    named = "; ".join(f"{layer.size_bytes / GB:.2f} GB: {layer.created_by[:80]}" for layer in largest)
    raise BuildError(f"{variant_id}: the image is {size_bytes / GB:.2f} GB, over its flavour's size budget of "
                     f"{budget_gb:g} GB (matrix.yaml size_budget_gb); largest layers: {named}")
