"""The chat page at `/`: self-contained (works offline), and in headless Chromium it sends a
message and shows the streamed answer, with thinking folded."""

import re
import shutil

import pytest

from server_fixtures import ServerProcess, model_args, wait_until

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run", "--disable-dev-shm-usage", "--window-size=1100,900"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess([*model_args(tmp_path_factory), "--served-model-name", "tiny", "--max-model-len", "1024"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (pip install selenium)")
    from selenium.webdriver.chrome.service import Service

    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not binary or not driver_path:
        pytest.skip("needs Chromium and its driver: apt-get install chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


def test_chat_page_is_served_and_self_contained(server):
    status, html = server.get("/")
    assert status == 200 and "<title>roofline chat</title>" in html
    # no CDN or other remote assets: it must work offline
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html, re.I)
    assert not re.search(r"@import|url\(\s*['\"]?https?:", html, re.I)


def api_answer(server, messages, thinking: bool, max_tokens: int):
    status, body = server.post("/v1/chat/completions", {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": max_tokens,
                                                        "chat_template_kwargs": {"enable_thinking": thinking}})
    assert status == 200, body
    message = body["choices"][0]["message"]
    return message["content"] or "", message.get("reasoning_content") or ""


def test_chat_page_streams_an_answer_in_chromium(server, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    browser.get(server.url + "/")
    assert wait_until(lambda: "tiny" in browser.find_element(By.ID, "model").text, timeout=15)
    assert not browser.find_element(By.ID, "key-label").is_displayed()  # no --api-key: no key field
    browser.find_element(By.ID, "temperature").send_keys("0")
    browser.find_element(By.ID, "max-tokens").send_keys("40")
    # count incremental text updates of the answer: more than one means it streamed
    browser.execute_script("""
        window.updates = 0;
        new MutationObserver((records) => {
            for (const r of records) {
                const el = r.target.nodeType === 1 ? r.target : r.target.parentElement;
                if (el && (el.classList.contains('content') || el.classList.contains('reasoning'))) window.updates++;
            }
        }).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true});
    """)
    box = browser.find_element(By.ID, "input")
    box.send_keys("Tell me a joke about atoms.")
    box.send_keys(Keys.ENTER)

    def finished():
        done = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-state=done], .msg.assistant[data-state=error]")
        return done[-1] if done else None

    message = wait_until(finished, timeout=60)
    assert message is not None and message.get_attribute("data-state") == "done", browser.page_source[-2000:]
    content = browser.execute_script("return arguments[0].querySelector('.content').textContent", message)
    reasoning = browser.execute_script("return arguments[0].querySelector('.reasoning').textContent", message)
    folded = browser.execute_script("const d = arguments[0].querySelector('details'); return [d.hidden, d.open]", message)
    browser.execute_script("arguments[0].querySelector('details').open = true", message)
    browser.save_screenshot(str(tmp_path / "chat.png"))
    browser.execute_script("arguments[0].querySelector('details').open = false", message)

    # the page shows what the API answers for the same request (greedy), thinking apart and folded
    want_content, want_reasoning = api_answer(server, [{"role": "user", "content": "Tell me a joke about atoms."}], True, 40)
    assert (content, reasoning) == (want_content, want_reasoning)
    assert content or reasoning
    if reasoning:
        assert folded == [False, False]  # shown, folded
    assert browser.execute_script("return window.updates") > 1
    assert "finish:" in message.find_element(By.CSS_SELECTOR, ".stats").text

    # a second turn carries the conversation
    box.send_keys("And another one, without thinking.")
    browser.find_element(By.ID, "thinking").click()
    box.send_keys(Keys.ENTER)
    assert wait_until(lambda: len(browser.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-state=done]")) == 2, timeout=60), browser.page_source[-2000:]
    second = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]
    history = [{"role": "user", "content": "Tell me a joke about atoms."}, {"role": "assistant", "content": want_content},
               {"role": "user", "content": "And another one, without thinking."}]
    want2, reasoning2 = api_answer(server, history, False, 40)
    assert browser.execute_script("return arguments[0].querySelector('.content').textContent", second) == want2
    assert not browser.find_elements(By.CSS_SELECTOR, ".msg .error")
