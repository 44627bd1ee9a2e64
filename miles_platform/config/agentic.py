"""Multi-turn and agentic rollouts (docs/rollout.md): the tool-call flags of the multi_turn
generate function, the agent function of agentic_tool_call and the TITO session server."""

from __future__ import annotations

from dataclasses import dataclass

from miles_platform.config.flags import POSITIVE, changed_flags, flag, flag_name
from miles_platform.errors import ConfigError

# --tito-model: the turn formats built here (rollout/tito.py has one table entry per name) and Miles'
# names whose turn format is not, with what each needs
TITO_BUILT = ("default", "qwen3", "qwen25", "qwen2", "llama3", "qwen35", "qwennext", "nemotron3", "glm47",
              "minimax_m25", "minimax_m27", "deepseekv32")  # fmt: skip
TITO_NOT_BUILT = {
    "kimi25": "Kimi K2.5's <|im_assistant|> segments and Miles' patched kimi_k25_fixed.jinja",
    "kimi26": "Kimi K2.6's <|im_assistant|> segments and its kimi_k2_raw_id tool-call parser",
    "deepseekv4": "DeepSeek-V4's encoder and its deepseekv4 tool-call parser",
    "inkling": "Miles' inkling_fixed.jinja and its inkling tool-call parser",
}

RANGES: dict[str, tuple] = {
    "generate_max_turns": POSITIVE,
    "generate_tool_timeout": (0, None, True, "> 0 (seconds)"),
    "custom_agent_function_timeout": (0, None, True, "> 0 (seconds)"),
    "custom_generate_function_timeout": (0, None, False, ">= 0 (seconds; 0 = no bound)"),
    "max_seq_len": POSITIVE,
    "session_server_port": (0, 65535, False, "a port in [0, 65535] (0: a free one)"),
}


@dataclass
class AgenticFlags:
    generate_max_turns: int = flag(16, "rollout", "multi_turn: max model turns per episode")
    generate_tool_specs_path: str | None = flag(
        None, "rollout", "multi_turn: <module>.<attr>, a list of OpenAI tool specs (or a fn returning one)"
    )
    generate_tool_call_parser: str | None = flag(
        None,
        "rollout",
        "multi_turn: tool-call format in model text (SGLang parser names)",
        choices=("qwen25", "qwen", "qwen3_coder", "glm47", "minimax-m2", "deepseekv32"),
    )
    generate_execute_tool_function_path: str | None = flag(
        None, "rollout", "multi_turn: async <module>.<fn>(name: str, params: dict) -> str"
    )
    generate_tool_timeout: float = flag(
        60.0, "rollout", "multi_turn: seconds one tool call may take; past it the episode ends as failed"
    )
    # agentic sessions (docs/rollout.md): generate_hub.agentic_tool_call + the TITO session server
    custom_agent_function_path: str | None = flag(
        None,
        "rollout",
        "agentic_tool_call: async <module>.<fn>(base_url, prompt, request_kwargs, metadata, **kwargs) -> dict | None",
    )
    custom_agent_function_mode: str = flag(
        "subproc",
        "rollout",
        "agentic_tool_call: run each agent call in a child process of its own (subproc) or on the rollout's loop",
        choices=("subproc", "inline"),
    )
    custom_generate_function_timeout: float = flag(
        1800.0,
        "rollout",
        "seconds one --custom-generate-function-path call may take; past it it is cancelled and its "
        "sample failed (rollout/failed); 0 = no bound",
    )
    custom_agent_function_timeout: float = flag(
        600.0,
        "rollout",
        "agentic_tool_call: seconds one agent call may take; past it it is stopped, the sample failed",
    )
    use_session_server: str | None = flag(
        None,
        "rollout",
        "start the TITO session server: bare or v1 (linear, append-only); v2 (tree) is refused",
        choices=("v1", "v2"),
        nargs="?",
        const="v1",
    )
    tito_model: str = flag(
        "default",
        "rollout",
        "TITO family: its end-of-turn token joins turns (default: the tokenizer's EOS)",
        choices=(*TITO_BUILT, *TITO_NOT_BUILT),
    )
    max_seq_len: int | None = flag(
        None, "rollout", "session server: max tokens per session (prompt + all turns)"
    )
    session_server_ip: str = flag("127.0.0.1", "rollout", "session server bind address")
    session_server_port: int = flag(0, "rollout", "session server port (0: a free one)")

    def _normalize_session_server(self) -> None:
        if isinstance(self.use_session_server, bool):  # YAML `use_session_server: true` is the bare flag
            self.use_session_server = "v1" if self.use_session_server else None

    def _check_generate_flags(self) -> None:
        """The multi-turn flags act through a generate function; a rollout function owns the whole
        rollout, which the fully async worker would bypass. (Imports are checked before start.)"""
        tool_flags = (
            "generate_tool_specs_path",
            "generate_tool_call_parser",
            "generate_execute_tool_function_path",
        )
        given = [flag_name(n) for n in tool_flags if getattr(self, n)]
        if given and not self.custom_generate_function_path:
            raise ConfigError(
                f"{', '.join(given)}: read by a generate function; set --custom-generate-function-path "
                "miles_platform.rollout.generate_hub.multi_turn.generate (or your own)"
            )
        self._check_agentic_flags()
        if self.rollout_function_path and self.fully_async:
            raise ConfigError(
                "--rollout-function-path with --fully-async: the rollout function replaces the rollout the "
                "fully async worker runs; drop one (a per-sample --custom-generate-function-path works with both)"
            )

    def _check_agentic_flags(self) -> None:
        """--use-session-server (bare/v1; v2 refused), the agent flags only with the agentic wrapper,
        the session flags only with the session server."""
        from miles_platform.plugins import AGENTIC, MILES_BUILTINS

        if self.use_session_server not in (None, "v1"):
            raise ConfigError(
                f"--use-session-server {self.use_session_server}: only v1 (the linear, append-only server; "
                "pass the bare flag) is implemented; Miles' experimental v2 tree server is not"
            )
        path = self.custom_generate_function_path
        agentic = MILES_BUILTINS.get(path, path) == AGENTIC
        if agentic and not self.custom_agent_function_path:
            raise ConfigError(f"--custom-generate-function-path {path} needs --custom-agent-function-path")
        if agentic and not self.use_session_server:
            raise ConfigError(f"--custom-generate-function-path {path} needs --use-session-server (v1)")
        if agentic and self.apply_chat_template:
            raise ConfigError(
                "--apply-chat-template with agentic_tool_call: the session server renders the template; "
                "Sample.prompt must stay a messages list (drop --apply-chat-template)"
            )
        agent_flags = (
            "custom_agent_function_path",
            "custom_agent_function_mode",
            "custom_agent_function_timeout",
        )
        given = changed_flags(self, agent_flags)
        if given and not agentic:
            raise ConfigError(
                f"{', '.join(given)}: read by --custom-generate-function-path "
                "miles.rollout.generate_hub.agentic_tool_call.generate; set it"
            )
        session_flags = ("tito_model", "max_seq_len", "session_server_ip", "session_server_port")
        given = changed_flags(self, session_flags)
        if given and not self.use_session_server:
            raise ConfigError(f"{', '.join(given)}: session server flags; set --use-session-server")
        if self.tito_model in TITO_NOT_BUILT:
            raise ConfigError(
                f"--tito-model {self.tito_model}: Miles' turn format for it ({TITO_NOT_BUILT[self.tito_model]}) is "
                f"not built here; built: {', '.join(TITO_BUILT)} (docs/models.md)"
            )
