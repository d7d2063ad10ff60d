"""The model card (``README.md``) of an output folder, as the hub shows it.

It carries the source card's base model and licence fields, says how the
model was made (measurement, optimizer, GPTQ settings, the exact command),
shows the bit map, the quality figures once ``mlx_dq eval`` has run, and how
to load the folder. Parts that change later (results, the name to load it by)
sit between ``<!-- mlx-dq:NAME -->`` markers so they can be replaced without
touching the rest of a card a user may have edited.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from mlx_dq.conversion.report import bit_map

CARD_NAME = "README.md"
DEFAULT_BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the bundled smollm2-135m source
CARRIED_KEYS = ("base_model", "license", "license_name", "license_link", "language")
_FRONT = re.compile(r"\A---\s*\n(.*?)\n---\s*(\n|\Z)", re.S)


# --------------------------------------------------------------------------
# the source's card
# --------------------------------------------------------------------------
def front_matter(text: str) -> dict:
    """The YAML front matter of a model card's text as a dict ({} when it has none or it is not valid YAML)."""
    import yaml

    m = _FRONT.match(text)
    if not m:
        return {}
    try:
        data = yaml.safe_load(m.group(1))
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def _hub_card_text(repo_id: str) -> str | None:
    """A hub model's README.md when it can be had quickly (None offline or on any failure)."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return None
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(repo_id, "README.md", etag_timeout=5)).read_text(encoding="utf-8")
    except Exception:  # no card, offline, gated: the card simply has fewer fields
        return None


def source_metadata(source: Any) -> dict:
    """Base model and licence fields for the output card, from the source card's front matter when present.

    A hub source is itself the base model; a GGUF source's licence and languages
    come from its ``general.*`` metadata.
    """
    meta: dict = {}
    if source.kind in ("folder", "hub"):
        card = Path(source.path) / CARD_NAME
        text = card.read_text(encoding="utf-8", errors="replace") if card.is_file() else None
        if text is None and source.kind == "hub":
            text = _hub_card_text(source.spec)
        meta = {k: v for k, v in front_matter(text or "").items() if k in CARRIED_KEYS}
        if source.kind == "hub":
            meta["base_model"] = source.spec
    elif source.kind in ("gguf", "default"):
        gfile = getattr(source._raw, "gfile", None)
        lic = gfile.meta("general.license") if gfile is not None else None
        langs = gfile.meta("general.languages") if gfile is not None else None
        url = gfile.meta("general.base_model.0.repo_url") if gfile is not None else None
        if lic:
            meta["license"] = str(lic)
        if langs:
            meta["language"] = [str(x) for x in langs] if isinstance(langs, (list, tuple)) else str(langs)
        if url and "huggingface.co/" in str(url):
            meta["base_model"] = str(url).split("huggingface.co/", 1)[1].strip("/")
        if source.kind == "default":
            meta["base_model"] = DEFAULT_BASE_MODEL
    return meta


# --------------------------------------------------------------------------
# sections
# --------------------------------------------------------------------------
def _marked(name: str, body: str) -> str:
    return f"<!-- mlx-dq:{name} -->\n{body.rstrip()}\n<!-- /mlx-dq:{name} -->"


def replace_section(text: str, name: str, body: str) -> str:
    """``text`` with the marked section ``name`` replaced by ``body`` (appended at the end when it has none)."""
    pattern = re.compile(rf"<!-- mlx-dq:{re.escape(name)} -->\n.*?<!-- /mlx-dq:{re.escape(name)} -->", re.S)
    new = _marked(name, body)
    if pattern.search(text):
        return pattern.sub(lambda _: new, text, count=1)
    return text.rstrip() + "\n\n" + new + "\n"


def _fmt(x: Any, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def results_section(manifest: dict, folder_ref: str) -> str:
    """The "Results" section: KL, top-1 and perplexity against the source from the manifest's ``results``."""
    res = manifest.get("results")
    lines = ["## Results", ""]
    if not res:
        lines.append(f"Not evaluated yet. `mlx_dq eval {folder_ref}` measures KL divergence, top-1 agreement and "
                     "perplexity against the source model and writes them here.")
        return "\n".join(lines)
    ev = res.get("evaluation") or {}
    text = ev.get("text") or "the bundled evaluation text"
    shape = ""
    if ev.get("rows") and ev.get("seq_len"):
        shape = f", {ev['rows']} rows x {ev['seq_len']} tokens"
    elif ev.get("tokens"):
        shape = f", {ev['tokens']:,} tokens"
    lines += [
        f"Measured by `mlx_dq eval` against {'`' + str(ev['base']) + '`' if ev.get('base') else 'no base model'} "
        f"on {text} (digest {ev.get('text_digest', 'n/a')}{shape}, seed {ev.get('seed', 'n/a')})"
        + (f"; {ev['evaluated_as']}" if ev.get("evaluated_as") else "") + ".",
        "",
        "| measure | value |",
        "|---|---:|",
        f"| KL divergence vs source (nats/token, mean) | {_fmt(res.get('kl_divergence'), '.4f')} |",
        f"| top-1 agreement with source | {_fmt(res.get('top1_agreement'), '.4f')} |",
        f"| perplexity | {_fmt(res.get('perplexity'), '.3f')} |",
        f"| source perplexity | {_fmt(res.get('base_perplexity'), '.3f')} |",
        f"| bits per weight (codes + 16-bit scales/biases, 16-bit others) | {_fmt(res.get('bits_per_weight'), '.3f')} |",
    ]
    if res.get("model_size_bytes"):
        lines.append(f"| size on disk | {res['model_size_bytes'] / 2**20:.1f} MiB |")
    return "\n".join(lines)


def load_section(manifest: dict, ref: str) -> str:
    """The "Use" section: stock mlx-lm for compatible folders; mlx-dq or trust_remote_code for mixed ones."""
    mixed = bool(manifest.get("mixed_modules"))
    lines = ["## Use", ""]
    if not mixed:
        lines += [
            "Every tensor is one of MLX's own quantized layers: stock mlx-lm loads this model.",
            "",
            "```bash",
            "pip install mlx-lm",
            f'mlx_lm.generate --model {ref} --prompt "What is the capital of France?"',
            f"mlx_lm.server --model {ref}   # OpenAI-compatible chat completions",
            "```",
            "",
            "```python",
            "from mlx_lm import load, generate",
            "",
            f'model, tokenizer = load("{ref}")',
            'messages = [{"role": "user", "content": "What is the capital of France?"}]',
            "prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)",
            "print(generate(model, tokenizer, prompt=prompt, verbose=True))",
            "```",
        ]
        return "\n".join(lines)
    lines += [
        f"{len(manifest['mixed_modules'])} tensor{'s are' if len(manifest['mixed_modules']) != 1 else ' is'} "
        "mixed-proportion (parts of the input channels at different bit widths), a layer stock mlx-lm does not "
        "have. Load it with mlx-dq (`pip install mlx-dq`), from Python or with its `mlx_dq generate` command "
        "(`mlx_dq generate --help`):",
        "",
        "```python",
        "import mlx_dq",
        "from mlx_lm import generate",
        "",
        f'model, tokenizer = mlx_dq.load("{ref}")',
        'print(generate(model, tokenizer, prompt="What is the capital of France?", verbose=True))',
        "```",
        "",
        "or with mlx-lm's own commands and `--trust-remote-code` (mlx-dq must be installed):",
        "",
        "```bash",
        f'mlx_lm.generate --model {ref} --trust-remote-code --prompt "What is the capital of France?"',
        f"mlx_lm.server --model {ref} --trust-remote-code",
        "```",
        "",
        "**Security note:** with `--trust-remote-code` (`trust_remote_code=True`) mlx-lm imports and runs whatever "
        "Python file config.json's `model_file` names, here `mlx_dq_model.py`. Read it before you trust it: as "
        "written by mlx-dq it only imports `mlx_dq.loader`. `mlx_dq.load` runs no file from the folder.",
    ]
    return "\n".join(lines)


def _distill_line(rec: dict) -> str:
    """The card's line for a distilled folder: settings and the KL on the training rows before and after."""
    d = rec.get("settings", {})
    return (f"- **Distillation:** scales and biases trained against the source's logits (codes fixed): "
            f"{d.get('steps', 'n/a')} Adam steps, lr {d.get('lr', 'n/a')}, {d.get('rows', 'n/a')} rows x "
            f"{d.get('seq_len', 'n/a')} tokens of {'the bundled calibration text' if d.get('calib') in (None, 'default') else d['calib']}"
            f", seed {d.get('seed', 'n/a')}; KL on those rows {_fmt(rec.get('kl_train_before'), '.4f')} -> "
            f"{_fmt(rec.get('kl_train_after'), '.4f')}.")


def _method_section(manifest: dict) -> str:
    prov = manifest.get("provenance", {})
    settings = prov.get("settings", {})
    plan = prov.get("plan", {})
    cal = prov.get("calibration", {})
    acc = manifest.get("accounting", {})
    src = "the bundled calibration text" if cal.get("source") in (None, "default") else f"`{cal['source']}`"
    method = settings.get("method", "gptq")
    if method == "gptq":
        quant = (f"GPTQ error compensation (act-order, damping {settings.get('damp', 'n/a')}), "
                 f"{'sequential (each layer calibrated on the already-quantized earlier layers)' if settings.get('sequential', True) else 'non-sequential'}, "
                 f"{'with' if settings.get('clip', True) else 'without'} the per-group clip search")
    else:
        quant = f"round-to-nearest {'with' if settings.get('clip', True) else 'without'} the per-group clip search"
    target = plan.get("target_bpw")
    if plan.get("method") == "recipe":
        measured = "- **Plan:** a fixed per-tensor recipe given to the converter (nothing measured)."
    else:
        measured = ("- **Measurement:** for every quantizable tensor, the relative output error of each candidate "
                    "option (uniform and mixed-proportion bit widths and group sizes) on captured calibration inputs, "
                    "weighted by the tensor's measured damage to the model's output.")
    lines = [
        "## Method",
        "",
        measured,
        f"- **Calibration:** {src}, {cal.get('rows', 'n/a')} rows x {cal.get('seq_len', 'n/a')} tokens, "
        f"seed {cal.get('seed', 'n/a')} (digest {cal.get('text_digest', 'n/a')}).",
        f"- **Optimizer:** one option per tensor for a {_fmt(target, 'g')} bpw target with the least predicted "
        f"damage ({plan.get('method', 'n/a')}): achieved {_fmt(plan.get('achieved_bpw'), '.4f')} bpw, "
        f"objective {_fmt(plan.get('objective'), '.4g')}, lower bound {_fmt(plan.get('lower_bound'), '.4g')}.",
        f"- **Quantization:** {quant}.",
        *([_distill_line(prov["distill"])] if prov.get("distill") else []),
        f"- **Output:** {_fmt(acc.get('average_bits_all'), '.3f')} bits per weight over all quantizable tensors, "
        f"{_fmt((acc.get('weights_on_disk_bytes') or 0) / 2**20, '.1f')} MiB of weights; "
        + ("whole-tensor options only (`--mlx-lm-compatible`)" if settings.get("mlx_lm_compatible")
           else "mixed tensors stored as uniform ones (`--promote-mixed`)" if settings.get("promote_mixed")
           else "mixed-proportion tensors allowed") + ".",
        f"- **Versions:** mlx-dq {manifest.get('mlx_dq', 'n/a')}, mlx-lm {manifest.get('mlx_lm', 'n/a')}, "
        f"mlx {manifest.get('mlx', 'n/a')}.",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------
# the whole card
# --------------------------------------------------------------------------
def render_card(manifest: dict, *, name: str, ref: str, metadata: dict | None = None, command: str | None = None) -> str:
    """The full card text for an output folder described by ``manifest``.

    ``name`` titles the card, ``ref`` is what users pass to load it (a repo id or
    a path), ``metadata`` the carried source fields, ``command`` the command that made it.
    """
    import yaml

    meta = dict(metadata or {})
    meta.setdefault("library_name", "mlx")
    meta.setdefault("pipeline_tag", "text-generation")
    meta["tags"] = ["mlx", "mlx-dq", "quantized", "mixed-precision"]
    src = manifest.get("provenance", {}).get("source", {})
    base = meta.get("base_model") or src.get("spec") or "the source model"
    acc = manifest.get("accounting", {})
    front = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True).strip()
    grid = bit_map({k: v for k, v in manifest.items() if k != "results"})
    command = command or manifest.get("provenance", {}).get("command")
    parts = [
        f"---\n{front}\n---",
        f"# {name}",
        f"`{base}` quantized with mlx-dq (measurement-driven mixed precision for MLX) to "
        f"{_fmt(acc.get('average_bits_all'), '.2f')} bits per weight on average, each tensor at the bit width its "
        "measured sensitivity earns.",
        _method_section(manifest),
        "## Bit map\n\nBits per weight of each tensor, one row per decoder layer (`mlx_dq inspect` prints the same):"
        f"\n\n```text\n{grid}\n```",
        _marked("results", results_section(manifest, ref)),
        "## How it was made\n\n```bash\n" + (command or "(not recorded)")
        + "\n```",
        _marked("load", load_section(manifest, ref)),
    ]
    return "\n\n".join(parts) + "\n"


def write_card(folder: str | Path, manifest: dict, *, name: str | None = None, ref: str | None = None,
               metadata: dict | None = None, command: str | None = None) -> Path:
    """Write ``folder/README.md`` from ``manifest`` (see :func:`render_card`) and return its path."""
    folder = Path(folder)
    path = folder / CARD_NAME
    ref = ref or str(folder)
    path.write_text(render_card(manifest, name=name or Path(ref).name, ref=ref, metadata=metadata,
                                command=command), encoding="utf-8")
    return path


def update_card(folder: str | Path, manifest: dict, *, ref: str | None = None) -> Path:
    """Refresh the results section of ``folder``'s card, and its load section when ``ref`` is given.

    The card is written whole when the folder has none.
    """
    folder = Path(folder)
    path = folder / CARD_NAME
    if not path.is_file():
        return write_card(folder, manifest, ref=ref)
    text = path.read_text(encoding="utf-8")
    text = replace_section(text, "results", results_section(manifest, str(folder)))
    if ref is not None:
        text = replace_section(text, "load", load_section(manifest, ref))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def note_distillation(folder: str | Path, manifest: dict) -> None:
    """Put the distillation line of ``manifest`` into ``folder``'s card (after its quantization line), if both exist."""
    path = Path(folder) / CARD_NAME
    rec = manifest.get("provenance", {}).get("distill")
    if not rec or not path.is_file():
        return
    lines = [ln for ln in path.read_text(encoding="utf-8").split("\n") if not ln.startswith("- **Distillation:**")]
    at = next((i + 1 for i, ln in enumerate(lines) if ln.startswith("- **Quantization:**")), None)
    if at is None:
        return
    lines.insert(at, _distill_line(rec))
    path.write_text("\n".join(lines), encoding="utf-8")

