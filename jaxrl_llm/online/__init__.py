"""`jaxrl-llm online`: sample → reward → group transform → update in one program, with a
staleness knob (docs/online.md). Built on the public API (`jaxrl_llm.api`)."""
