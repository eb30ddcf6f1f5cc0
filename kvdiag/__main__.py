from kvdiag.cli.main import run

run()
