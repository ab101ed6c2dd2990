"""The sampling defaults a model ships in generation_config.json, checked key by key."""

from __future__ import annotations

from pathlib import Path

from freetoken.runtime.json_keys import BOOL, COUNT, FRACTION, NON_NEGATIVE, JsonObject, Kind, read_json

SAMPLING_KEYS: tuple[tuple[str, Kind], ...] = (
    ("temperature", NON_NEGATIVE),
    ("top_p", FRACTION),
    ("top_k", COUNT),
)


def generation_defaults(model_dir: Path) -> dict[str, float | int]:
    """temperature, top_p and top_k from generation_config.json, those it sets ({} without the file);
    `do_sample: false` means greedy. A wrong type or value is one line naming the file and the key."""
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return {}
    config = JsonObject(read_json(path), str(path))
    if config.get("do_sample", BOOL, None) is False:
        return {"temperature": 0.0}
    values = {key: config.get(key, kind, None) for key, kind in SAMPLING_KEYS}
    return {key: value for key, value in values.items() if value is not None}
