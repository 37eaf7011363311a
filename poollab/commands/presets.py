"""``poollab presets``: the model and GPU presets ``simulate`` (``--model``, ``--gpu``) accepts."""

from __future__ import annotations

import click


def register(cli: click.Group) -> None:
    cli.add_command(presets_command)


@click.command("presets")
def presets_command() -> None:
    """List the model and GPU presets (shapes, context limits, memory, rates, links)."""
    import pandas as pd

    from sim.replay.hardware import available_gpus, load_gpu
    from sim.replay.models import available_models, load_model

    models = []
    for name in available_models():
        m = load_model(name)
        models.append(
            {
                "model": name,
                "params_B": m.param_count / 1e9,
                "dtype": m.dtype,
                "layers": m.num_layers,
                "hidden": m.hidden_size,
                "heads": m.num_heads,
                "kv_heads": m.num_kv_heads,
                "kv_KiB_per_token": m.kv_bytes_per_token / 1024,
                "max_model_len": m.max_position_embeddings,
                "weights_GiB": m.weight_bytes / 2**30,
            }
        )
    gpus = []
    for name in available_gpus():
        g = load_gpu(name)
        gpus.append(
            {
                "gpu": name,
                "memory_GiB": g.memory_bytes / 2**30,
                "hbm_TB_s": g.hbm_bandwidth_bytes_per_s / 1e12,
                "bf16_TFLOPS": g.bf16_flops_per_s / 1e12,
                "pcie_GB_s": g.pcie_bandwidth_bytes_per_s / 1e9,
                "link_GB_s": g.link_bytes_per_s / 1e9,
            }
        )
    fmt = lambda v: f"{v:,.2f}"  # noqa: E731
    click.echo(
        "models (--model NAME, Hugging Face ids too; "
        "max_model_len is the model's max_position_embeddings):"
    )
    click.echo(pd.DataFrame(models).to_string(index=False, float_format=fmt))
    click.echo(
        "\nGPUs (--gpu NAME; link_GB_s: GPU-to-GPU per direction, what --tp's all-reduces use):"
    )
    click.echo(pd.DataFrame(gpus).to_string(index=False, float_format=fmt))
    click.echo(
        "\nA model or GPU of your own: a JSON file with the same fields (sim/replay/models.py, "
        "sim/replay/hardware.py)."
    )
