"""Everyday command-line details: what `ask` calls its numbers, shell completion for every subcommand."""

from __future__ import annotations

# ---- ask: the answer's probability is `p`; "confidence" only for TypeSafe's formula, under that name -----------

def test_ask_names_the_largest_probability_p_and_typesafes_formula_by_its_name():
    from basal_local.commands.ask import chart

    # /v1/basal: its `confidence` is the largest p, so only p is printed
    basal = {"type": "choice", "choice": "refund", "probabilities": {"refund": 0.7, "repair": 0.3},
             "confidence": 0.7}
    text = chart("What?", basal, color=False)
    assert text.splitlines()[1] == "  → refund  (p = 0.700)" and "confidence" not in text
    # /v1/systemone: (0.7 - 1/2) / (1 - 1/2) = 0.4, a different number under its own name
    typesafe = {**basal, "confidence": 0.4}
    text = chart("What?", typesafe, color=False, dialect="systemone")
    assert "  → refund  (p = 0.700)\n    TypeSafe confidence 0.400 = (p - 1/n) / (1 - 1/n)" in text
    score = {"type": "score", "score": 0.25, "legend": {"0": "low", "1": "high"},
             "probabilities": {"0": 0.75, "1": 0.25}, "confidence": 0.75}
    assert chart("How bad?", score, color=False).splitlines()[1] == "  → score 0.25  (most likely 0 low, p = 0.750)"
    noul = {"type": "noul", "noul": 0.25, "probabilities": {"true": 0.25, "false": 0.75}, "confidence": 0.75}
    text = chart("Urgent?", noul, color=False)
    assert text.splitlines()[1] == "  → no  (p(true) = 0.250)" and "confidence" not in text


# ---- shell completion: generated from the parser, so every subcommand, option and choice is in it --------------

def _subcommands() -> set[str]:
    import argparse

    from basal_local.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices)


def _script(shell: str, tmp_path) -> str:
    from .test_cli import cli

    done = cli("completion", shell)
    assert done.returncode == 0, done.stderr
    path = tmp_path / f"basal-local.{shell}"
    path.write_text(done.stdout)
    return str(path)


def _bash_complete(script: str, *words: str) -> set[str]:
    """What bash offers for the command line `words` (the last word is the one being completed)."""
    import subprocess

    line = " ".join(f"'{w}'" for w in words)
    code = (f"source {script}\nCOMP_WORDS=({line}); COMP_CWORD={len(words) - 1}\n_basal_local\n"
            'printf "%s\\n" "${COMPREPLY[@]}"\n')
    done = subprocess.run(["bash", "--norc", "--noprofile", "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and not done.stderr, done.stderr
    return set(done.stdout.split())


def test_bash_completion_is_valid_and_completes_commands_options_choices_and_keys(tmp_path):
    import subprocess

    script = _script("bash", tmp_path)
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    names = _subcommands()
    assert {"serve", "config", "completion", "ask", "ls", "bench"} <= names
    assert names <= _bash_complete(script, "basal-local", "")
    assert _bash_complete(script, "basal-local", "con") == {"config"}
    assert _bash_complete(script, "basal-local", "serve", "--dev") == {"--device", "--devices"}
    assert _bash_complete(script, "basal-local", "serve", "--device", "") == {"auto", "cpu", "cuda", "mps"}
    # a global flag first and an option's value do not count as the subcommand or a positional
    assert _bash_complete(script, "basal-local", "-v", "serve", "--port", "8000", "--sch") == {"--schedule"}
    assert _bash_complete(script, "basal-local", "config", "s") == {"set", "show"}
    assert _bash_complete(script, "basal-local", "config", "set", "max_in") == {"max_inflight"}
    assert _bash_complete(script, "basal-local", "completion", "") == {"bash", "zsh", "fish"}
    assert _bash_complete(script, "basal-local", "run", "--output", "x") == set()  # file names (bash's default)


def test_zsh_and_fish_scripts_parse_and_name_every_subcommand(tmp_path):
    import shutil
    import subprocess

    names = _subcommands()
    for shell in ("zsh", "fish"):
        script = _script(shell, tmp_path)
        text = open(script).read()
        for name in names:
            assert (f"'{name}:" in text) if shell == "zsh" else (f"-a {name} " in text), (shell, name)
        if shutil.which(shell) is None:
            continue  # the text checks above still ran; the shell's own parse needs the shell
        assert subprocess.run([shell, "-n", script]).returncode == 0, shell
    if shutil.which("fish"):
        script = _script("fish", tmp_path)
        done = subprocess.run(["fish", "--no-config", "-c", f"source {script}; complete -C 'basal-local serve --dev'"],
                              capture_output=True, text=True, timeout=30)
        assert {line.split("\t")[0] for line in done.stdout.splitlines()} == {"--device", "--devices"}, done
        done = subprocess.run(["fish", "--no-config", "-c", f"source {script}; complete -C 'basal-local config set max_in'"],
                              capture_output=True, text=True, timeout=30)
        assert {line.split("\t")[0] for line in done.stdout.splitlines()} == {"max_inflight"}, done


def test_every_command_s_help_describes_it_with_an_example():
    import argparse

    from basal_local.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        text = command.format_help()
        assert command.description and "Example" in command.description, name
        assert "basal-local" in command.description.split("Example", 1)[1], name
        assert text.count("usage:") == 1, name
