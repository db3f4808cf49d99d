// Progressive enhancement only: every page is complete without this script.
// It swaps in fresh copies of the live sections ([data-part]) every few
// seconds and adds copy buttons to the suggested commands.
async function refresh() {
  for (const el of document.querySelectorAll('[data-part]')) {
    try {
      const r = await fetch(el.dataset.part, {cache: 'no-store'});
      if (r.ok) { el.innerHTML = await r.text(); }
    } catch (e) { /* the agent restarts: try again next time */ }
  }
  const s = document.getElementById('stamp');
  if (s) {   // local time, as the server prints it (ISO 8601 to the second)
    const d = new Date(), two = n => String(n).padStart(2, '0');
    s.textContent = d.getFullYear() + '-' + two(d.getMonth() + 1) + '-' + two(d.getDate())
      + 'T' + two(d.getHours()) + ':' + two(d.getMinutes()) + ':' + two(d.getSeconds());
  }
}
setInterval(refresh, {{ refresh_ms }});
for (const code of document.querySelectorAll('code.copyable')) {
  if (!navigator.clipboard) break;
  const b = document.createElement('button');
  b.className = 'copy'; b.type = 'button'; b.textContent = 'copy';
  b.addEventListener('click', () => navigator.clipboard.writeText(code.textContent));
  code.after(b);
}
