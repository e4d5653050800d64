from nanoserve.cli import main

main()
