from lra_cond.cli import console_main

if __name__ == "__main__":
    console_main()
