from nanoserve.cli import main

if __name__ == "__main__":  # not in spawned tensor-parallel workers, which import this module
    main()
