def main() -> int:  # replaced by the real CLI
    return 0
