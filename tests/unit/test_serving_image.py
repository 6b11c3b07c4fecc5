"""A serving-only image (torch-aot's final image): what the host leaves out of it, and what the runtime
says when a command needs what was left out. The image itself: tests/integration/test_hardened_image.py."""
from __future__ import annotations

from pathlib import Path

from builder.build import _link_tree
from builder.render import defaults
from builder.runtime import __main__ as runtime_main


def test_the_model_directory_ships_without_its_weights_where_the_engine_holds_them(tmp_path):
    model = tmp_path / "model"
    for name in ("config.json", "tokenizer.json", "model.safetensors", "pytorch_model.bin", "1_Pooling/config.json",
                 "2_Dense/model.safetensors", "onnx/model.onnx", ".cache/x", "vocab.txt"):
        (model / name).parent.mkdir(parents=True, exist_ok=True)
        (model / name).write_text(name)
    _link_tree(model, tmp_path / "out", tuple(defaults()["model_weight_files"]))
    shipped = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert shipped == ["1_Pooling/config.json", "config.json", "tokenizer.json", "vocab.txt"]
    _link_tree(model, tmp_path / "all")  # without patterns: every file but the hidden ones
    assert len([p for p in (tmp_path / "all").rglob("*") if p.is_file()]) == 8  # .cache/x stays out


def test_a_command_that_needs_a_left_out_package_says_so_in_one_line(monkeypatch, capsys):
    def needs_transformers(args):
        raise ModuleNotFoundError("No module named 'transformers'", name="transformers")

    monkeypatch.setitem(runtime_main.COMMANDS, "make-tiny-qwen3", needs_transformers)
    assert runtime_main.main(["make-tiny-qwen3", "--out", "/nonexistent/x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "make-tiny-qwen3 needs the Python package 'transformers'" in err
    assert "Traceback" not in err


def test_the_prune_list_keeps_what_serving_imports():
    # Measured: the served process imports these (PYTHONPROFILEIMPORTTIME); none may be pruned.
    served = {"torch", "numpy", "tokenizers", "uvicorn", "uvloop", "httptools", "orjson", "prometheus-client",
              "pyyaml", "tqdm", "click", "typing-extensions", "packaging", "filelock", "h11"}
    pruned = {n.lower().replace("_", "-") for n in defaults()["serving_prune"]["packages"]}
    assert not served & pruned
    assert Path("bin/torch_shm_manager").name not in defaults()["serving_prune"]["torch_paths"]
