from tilegen.cli import run

run()
