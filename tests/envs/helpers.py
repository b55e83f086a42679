"""Tokenizers and small environments for the envs tests (no model: a tokenizer is all the
environment layer needs)."""

from __future__ import annotations

import threading
from functools import cache, lru_cache
from typing import Any

from jaxrl_llm.envs.base import Environment, EnvResponse
from jaxrl_llm.models.tokenizer import train_bpe_tokenizer
from jaxrl_llm.tasks.base import Problem, RewardResult

# Qwen2.5-Instruct's chat template (its tokenizer_config.json, as published with the model):
# ChatML that lists `tools=` in the system turn and renders tool results as user turns of
# <tool_response> blocks. A real tool-capable template, not one written for these tests.
QWEN25_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user "
    "query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:"
    "\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": "
    "<function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>", "<|im_start|>", "<|im_end|>")
CORPUS = ["What is 12 * 7? The answer is 84.", "<tool_call>\n{\"name\": \"calculator\", "
          "\"arguments\": {\"expression\": \"12 * 7\"}}\n</tool_call>",
          "You are a helpful assistant. Use the tools.", "Try again: evaluates to 3, not 24."]


@cache
def qwen_tokenizer(template: str | None = QWEN25_TEMPLATE) -> Any:
    """A byte-level BPE with ChatML specials and Qwen2.5's tool-capable template (EOS is
    `<eos>`, not the template's `<|im_end|>`, as for Qwen2.5 base models)."""
    return train_bpe_tokenizer(CORPUS * 20, 420, SPECIALS, chat_template=template)


@lru_cache(maxsize=1)
def smollm2_tokenizer() -> Any:
    """SmolLM2-135M-Instruct's own tokenizer (ChatML without tool support), from its GGUF."""
    from jaxrl_llm.weights.gguf import read_gguf
    from jaxrl_llm.weights.packaged import smollm2_gguf_path

    return read_gguf(smollm2_gguf_path())[2]


def problem(i: int = 0, **metadata: Any) -> Problem:
    return Problem(id=f"p{i}", question=f"question {i}", answer="42", metadata=metadata)


class Scripted(Environment):
    """Answers each turn from a list of responses (or callables); score: +1 when the last
    turn says 42, −1 otherwise, a reward no test can get from anywhere else."""

    name = "scripted"

    def __init__(self, responses: list[Any], *, max_turns: int = 4) -> None:
        super().__init__()
        self.responses = responses
        self.max_turns = max_turns
        self.calls = 0

    def system_prompt(self, problem: Problem) -> str | None:
        return "Be brief."

    def user_prompt(self, problem: Problem) -> str:
        return problem.question

    def start(self, problem: Problem) -> dict:
        return {"turns": []}

    def respond(self, state: dict, model_text: str) -> EnvResponse:
        state["turns"].append(model_text)
        response = self.responses[min(self.calls, len(self.responses) - 1)]
        self.calls += 1
        return response(state, model_text) if callable(response) else response

    def score(self, state: dict, problem: Problem, model_turns: list[str]) -> RewardResult:
        correct = bool(model_turns) and "42" in model_turns[-1]
        return RewardResult(1.0 if correct else -1.0, correct, not model_turns, None,
                            {"scored_turns": len(model_turns)})


class Gate:
    """An environment call that blocks until released (a hung environment, by construction)."""

    def __init__(self) -> None:
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.running = self.most = 0

    def __call__(self, state: dict, model_text: str) -> EnvResponse:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        self.entered.release()
        self.release.wait()
        with self.lock:
            self.running -= 1
        return EnvResponse([{"role": "user", "content": "go on"}], done=False)
