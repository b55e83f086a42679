"""The floor every other package stands on; imports nothing else of `jaxrl_llm`.

- `errors`: `ConfigError` and the other user-facing errors (exit 2, naming the key or file).
- `paths`: one path type for local paths and `gs://` (resolved once, when a config loads).
- `atomic`: outputs written whole or not at all (hidden temporary sibling, then rename).
- `signals`: how a long command stops on Ctrl-C / SIGTERM (exit 130 / 143, resumable).
- `progress`: progress bars on a terminal, plain lines in a log.
"""
