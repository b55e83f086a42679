"""`countdown_game`: Countdown (tasks/countdown.py) played over several turns with feedback.

Each model turn is one try: its `<answer>…</answer>` equation is checked by the task's own
verifier (`CountdownTask.check_equation`, exact rationals, never `eval`). A valid equation
ends the episode; an invalid or wrong one gets the verifier's reason back as a user turn
("evaluates to 12, not 24", "a number is used more often than given", "no <answer> block")
and another try, up to `max_turns` tries. The reward is the task's score of the last try, so
an episode that runs out of tries gets the task's reward for a wrong answer.
"""

from __future__ import annotations

import dataclasses

from jaxrl_llm.envs.base import Environment, EnvResponse
from jaxrl_llm.tasks.base import Problem, Task
from jaxrl_llm.tasks.countdown import CountdownTask, extract_answer_block


@dataclasses.dataclass
class GameState:
    problem: Problem
    tries: int = 0
    solved: bool = False
    reasons: list[str] = dataclasses.field(default_factory=list)


class CountdownGame(Environment):
    """env.name: countdown_game (data.task: countdown, or none: generated puzzles)."""

    name = "countdown_game"
    max_turns = 4

    def __init__(self, *, task: Task | None = None, max_turns: int | None = None) -> None:
        task = CountdownTask() if task is None else task
        if not isinstance(task, CountdownTask):
            raise TypeError(f"environment 'countdown_game' plays the countdown task, not "
                            f"{getattr(task, 'name', type(task).__name__)!r} (set data.task: "
                            "countdown)")
        super().__init__(task=task)
        self.game: CountdownTask = task
        if max_turns is not None:
            self.max_turns = max_turns

    def user_prompt(self, problem: Problem) -> str:
        # The task's prompt opens a <think> block for raw text; a chat turn does not need it.
        prompt = str(self.game.prompt(problem)).removesuffix("\n<think>")
        return (f"{prompt}\nIf your equation is wrong you will be told why and may try again "
                f"(up to {self.max_turns} tries).")

    def start(self, problem: Problem) -> GameState:
        return GameState(problem)

    def respond(self, state: GameState, model_text: str) -> EnvResponse:
        state.tries += 1
        block = extract_answer_block(model_text)
        if block is None:
            reason = "no <answer> ... </answer> block"
        else:
            meta = state.problem.metadata
            valid, reason = self.game.check_equation(block.split("=", 1)[0],
                                                     meta["numbers"], meta["target"])
            if valid:
                state.solved = True
                return EnvResponse([], done=True, info={"tries": state.tries, "valid": True})
        state.reasons.append(reason)
        feedback = f"That is not a solution: {reason}. Try again."
        return EnvResponse([{"role": "user", "content": feedback}], done=False,
                           info={"tries": state.tries, "valid": False, "reason": reason})
