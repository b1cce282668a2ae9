def main() -> None:
    print("olp")
