from .agent import main

main(prog_name="recovery-agent")
