"""A hypothesis strategy of small random JSON schemas (objects of booleans, bounded
integers, enums, short patterned strings and short arrays) for structured outputs."""

from __future__ import annotations

from hypothesis import strategies as st


def property_schemas() -> st.SearchStrategy:
    enum = st.lists(st.text(alphabet="abcxyz", min_size=1, max_size=4), min_size=1, max_size=3, unique=True)
    return st.one_of(
        st.just({"type": "boolean"}),
        st.tuples(st.integers(-50, 50), st.integers(0, 200)).map(
            lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
        enum.map(lambda e: {"enum": e}),
        st.integers(1, 6).map(lambda n: {"type": "string", "maxLength": n, "pattern": "^[a-z]*$"}),
        st.just({"type": "array", "items": {"type": "boolean"}, "maxItems": 3}),
    )


schemas = st.dictionaries(st.sampled_from(["a", "b", "c", "name", "n"]), property_schemas(), min_size=1,
                          max_size=3).map(lambda props: {"type": "object", "properties": props,
                                                         "required": sorted(props), "additionalProperties": False})
