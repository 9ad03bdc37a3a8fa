"""The config loader on anything a user might write: every YAML document and every ``key=value``
override either loads into a valid config or is one clean error (ConfigError), never a traceback."""

import dataclasses

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bidirl.config import PipelineConfig, load_config
from bidirl.errors import BidirlError


def dotted_keys(cls, prefix=""):
    keys = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type) or (isinstance(f.default_factory, type)
                                                and dataclasses.is_dataclass(f.default_factory)):
            keys += dotted_keys(f.default_factory, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


KEYS = dotted_keys(PipelineConfig)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**12), st.floats(allow_nan=True),
                    st.text(max_size=12), st.sampled_from(["sync", "bidirl", "cuda", "tiny", "1e-3", "[a]", "{}"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                         max_size=3), max_leaves=6)
key = st.one_of(st.sampled_from(KEYS), st.text(min_size=1, max_size=15))


def nested(dotted: str, value):
    out = value
    for part in reversed(dotted.split(".")):
        out = {part: out}
    return out


documents = st.one_of(
    st.lists(st.tuples(key, values), max_size=4).map(lambda kvs: yaml.safe_dump(
        {k: v for d in (nested(k, v) for k, v in kvs) for k, v in d.items()}, allow_unicode=True)),
    st.text(max_size=80),  # not even YAML, perhaps
)
overrides = st.lists(st.one_of(st.builds(lambda k, v: f"{k}={v}", st.sampled_from(KEYS), st.text(max_size=10)),
                               st.text(max_size=20)), max_size=3)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(document=documents, extra=overrides)
def test_any_document_and_override_loads_or_is_one_clean_error(tmp_path, document, extra):
    path = tmp_path / "pipeline.yaml"
    path.write_text(document, encoding="utf-8")
    try:
        cfg = load_config(path, extra)
    except BidirlError as exc:
        message = str(exc)
        assert message and "\n" not in message.strip() and "Traceback" not in message
        return
    assert isinstance(cfg, PipelineConfig)
