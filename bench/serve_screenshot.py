"""The README's screenshot of the page of `aiayn serve`: starts the server on a free loopback port,
opens the page in headless Chromium (Debian's chromium + chromium-driver, through selenium), types a
sentence, presses Ctrl+Enter, hovers a target token and saves the window as a PNG.

    python bench/serve_screenshot.py --checkpoint /work/runs/m30k-de-en --out docs/serve-page.png
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait
from serve import Server  # bench/serve.py, beside this script

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--out", default="docs/serve-page.png")
    p.add_argument("--sentence", default="Ein kleines Mädchen in einem roten Kleid spielt mit einem Hund im Park.")
    p.add_argument("--hover", type=int, default=3, help="index of the target token to hover")
    p.add_argument("--size", default="1100,1250", help="window width,height")
    args = p.parse_args()
    server = Server(args.checkpoint)  # bench/serve.py's: a free loopback port, ready once /health says so
    driver = None
    try:
        os.environ.setdefault("SE_OFFLINE", "true")
        options = webdriver.ChromeOptions()
        options.binary_location = "/usr/bin/chromium"
        for flag in FLAGS + [f"--window-size={args.size}", f"--user-data-dir={tempfile.mkdtemp()}"]:
            options.add_argument(flag)
        driver = webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))
        driver.get(server.url)
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: "→" in d.find_element(By.ID, "pair").text)
        driver.find_element(By.ID, "source").send_keys(args.sentence)
        ActionChains(driver).key_down(Keys.CONTROL).send_keys(Keys.ENTER).key_up(Keys.CONTROL).perform()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#tgt-tokens .tgt-token"))
        tokens = driver.find_elements(By.CSS_SELECTOR, "#tgt-tokens .tgt-token")
        ActionChains(driver).move_to_element(tokens[min(args.hover, len(tokens) - 1)]).perform()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(args.out)
        print(f"{args.out}: {driver.find_element(By.ID, 'translation').text}")
    finally:
        if driver is not None:
            driver.quit()
        server.stop()


if __name__ == "__main__":
    main()
