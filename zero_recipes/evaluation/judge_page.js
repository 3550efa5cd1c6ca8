// The judging half of a two-column side-by-side page (page.py inlines this file). Plain JavaScript with no
// library and nothing fetched, so the page works from file:// as one file. Choices live in localStorage under
// the page's identity, written as each is made: a reload or a closed tab loses nothing, and a regenerated page
// (other answers, another identity) starts empty.
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("judging-data").textContent);
  const key = "zero-recipes-judgments:" + data.page;
  const rows = Array.from(document.querySelectorAll("tr[data-row]"));
  const nameBox = document.getElementById("judge");
  const statusLine = document.getElementById("status");
  let state = { judge: "", revealed: false, current: 0, choices: {} };
  try {
    state = Object.assign(state, JSON.parse(localStorage.getItem(key) || "{}"));
  } catch (err) {
    say("the saved choices could not be read; starting empty", true);
  }

  function save() {
    localStorage.setItem(key, JSON.stringify(state));
  }
  function say(text, warn) {
    statusLine.textContent = text;
    statusLine.className = warn ? "warn" : "";
  }
  function draw() {
    document.body.classList.toggle("revealed", state.revealed);
    document.getElementById("reveal").disabled = state.revealed;
    rows.forEach(function (tr, i) {
      const made = state.choices[data.rows[i].row];
      tr.classList.toggle("current", i === state.current);
      tr.querySelectorAll("button[data-choice]").forEach(function (b) {
        b.classList.toggle("chosen", Boolean(made) && made.choice === b.dataset.choice);
      });
    });
    const done = Object.keys(state.choices).length;
    document.getElementById("progress").textContent = done + " / " + rows.length + " judged";
  }
  function go(i, scroll) {
    state.current = Math.max(0, Math.min(rows.length - 1, i));
    save();
    draw();
    if (scroll) rows[state.current].scrollIntoView({ block: "center" });
  }
  function choose(i, choice) {
    state.choices[data.rows[i].row] = { choice: choice, revealed: state.revealed, at: new Date().toISOString() };
    go(i + 1 < rows.length ? i + 1 : i, true);
    say("saved in this browser");
  }

  function exportChoices() {
    const judge = nameBox.value.trim();
    if (!judge) {
      say("type your name in Judge first: it tells judges apart", true);
      nameBox.focus();
      return;
    }
    const lines = data.rows
      .filter(function (r) { return state.choices[r.row]; })
      .map(function (r) {
        const c = state.choices[r.row];
        return JSON.stringify({ page: data.page, judge: judge, row: r.row, prompt: r.prompt, left: r.left,
          right: r.right, choice: c.choice, revealed: c.revealed, at: c.at });
      });
    if (!lines.length) {
      say("nothing judged yet", true);
      return;
    }
    const a = document.createElement("a");
    a.href = URL.createObjectURL(new Blob([lines.join("\n") + "\n"], { type: "application/x-ndjson" }));
    a.download = "judgments-" + judge.replace(/[^A-Za-z0-9_.-]+/g, "_") + "-" + data.page + ".jsonl";
    document.body.appendChild(a);
    a.click();
    a.remove();
    say("exported " + lines.length + " judgments as " + a.download);
  }

  const byKey = { "1": "left", a: "left", "2": "right", b: "right", "3": "tie", t: "tie", "4": "both_bad", x: "both_bad" };
  document.addEventListener("keydown", function (ev) {
    if (ev.target === nameBox || ev.ctrlKey || ev.metaKey || ev.altKey) return;
    const k = ev.key.length === 1 ? ev.key.toLowerCase() : ev.key;
    if (byKey[k]) choose(state.current, byKey[k]);
    else if (k === "j" || k === "ArrowDown") go(state.current + 1, true);
    else if (k === "k" || k === "ArrowUp") go(state.current - 1, true);
    else return;
    ev.preventDefault();
  });
  rows.forEach(function (tr, i) {
    tr.addEventListener("click", function (ev) {
      const b = ev.target.closest("button[data-choice]");
      if (b) choose(i, b.dataset.choice);
      else go(i, false);
    });
  });
  nameBox.value = state.judge;
  nameBox.addEventListener("input", function () {
    state.judge = nameBox.value;
    save();
  });
  document.getElementById("reveal").addEventListener("click", function () {
    state.revealed = true;
    save();
    draw();
  });
  document.getElementById("export").addEventListener("click", exportChoices);
  draw();
})();
