"""Screenshot of the chat page of a running engine-serve (for docs/).

    python experiments/chat_screenshot.py --url http://127.0.0.1:8090 \
        --message "Hello! Who are you?" --out docs/images/chat-page.png

Drives Debian's headless chromium with selenium: types one message, waits for
the streamed answer to finish, saves a PNG.
"""

from __future__ import annotations

import argparse
import shutil
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8090")
    p.add_argument("--message", default="Hello! Who are you?")
    p.add_argument("--system", default="You are a helpful assistant.")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--out", default="docs/images/chat-page.png")
    args = p.parse_args(argv)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
              "--window-size=1200,640"):
        opts.add_argument(a)
    d = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    try:
        d.get(args.url + "/")
        d.find_element(By.ID, "system").send_keys(args.system)
        mt = d.find_element(By.ID, "max_tokens")
        mt.clear()
        mt.send_keys(str(args.max_tokens))
        d.find_element(By.ID, "input").send_keys(args.message, Keys.ENTER)
        t0 = time.monotonic()
        while d.find_element(By.ID, "status").text not in ("done", "error", "stopped"):
            if time.monotonic() - t0 > 120:
                raise SystemExit("no answer within 120 s")
            time.sleep(0.1)
        d.save_screenshot(args.out)
        print(args.out)
    finally:
        d.quit()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
