//! The pages' shared HTML: escaping, the layout with its stylesheet, number
//! formatting and pagers. Everything is rendered on the server; the pages
//! carry no script, so they work offline and in any browser.

use std::fmt::Write as _;

use axum::response::Html;

/// `text` made safe inside HTML text and attribute values.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// `text` as one path segment of a link (run and episode ids are names, but
/// a name may still hold characters a URL reserves).
pub fn segment(text: &str) -> String {
    percent_encode(text, b"")
}

/// `text` with every byte but URL-unreserved ones and those in `keep`
/// percent-encoded.
pub fn percent_encode(text: &str, keep: &[u8]) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            b if keep.contains(&b) => (b as char).to_string(),
            b => format!("%{b:02X}"),
        })
        .collect()
}

/// A number as the tables show it: 3 decimals, or `-` when there is none.
pub fn number(value: Option<f64>) -> String {
    match value {
        Some(v) if v.is_finite() => format!("{v:.3}"),
        _ => "-".to_owned(),
    }
}

const STYLE: &str = "
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{background:#1d2330;color:#fff;padding:8px 20px;display:flex;gap:20px;align-items:baseline}
header a{color:#cfe0ff;text-decoration:none}header b{font-size:16px}
main{padding:12px 20px;max-width:1400px}
table{border-collapse:collapse;background:#fff;margin:8px 0}
th,td{border:1px solid #dde1e8;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#eef1f5}td.n{text-align:right;font-variant-numeric:tabular-nums}
.charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(470px,1fr));gap:10px}
figure{margin:0;background:#fff;border:1px solid #dde1e8;padding:6px}
figcaption{font-weight:600}
.legend span{margin-right:10px}
.msg{background:#fff;border:1px solid #dde1e8;margin:6px 0;padding:6px 10px}
.msg pre,pre{white-space:pre-wrap;word-break:break-word;margin:4px 0}
.role{font-weight:600;text-transform:uppercase;font-size:12px;color:#5a6375}
.tokens{background:#fff;border:1px solid #dde1e8;padding:8px;font:12px/1.7 ui-monospace,monospace;white-space:pre-wrap;word-break:break-all}
.tok{border-radius:2px}.tok.trained{background:#c9f0cf;outline:1px solid #7fcf8c}
.tok.prompt{color:#6b7385}.tok.observation{background:#eef1f5}
.judged{background:#c9f0cf}
.unseen{background:#f6d2cf;text-decoration:line-through}
.good{color:#137333}.bad{color:#b3261e}
.pager a{margin-right:12px}
header form.out{display:inline;float:right}
";

/// A whole page: the header with the navigation, then `body`.
pub fn page(title: &str, body: &str) -> Html<String> {
    let mut out = String::with_capacity(body.len() + 2048);
    let _ = write!(
        out,
        "<!doctype html><html lang=en><head><meta charset=utf-8><title>{} · Sleuth</title><style>{STYLE}</style></head>\
         <body><header><b>Sleuth</b><a href=\"/\">Runs</a><a href=\"/evaluations\">Evaluations</a>\
         <form class=out method=post action=\"/logout\"><button>Sign out</button></form></header><main>",
        escape(title)
    );
    out.push_str(body);
    out.push_str("</main></body></html>");
    Html(out)
}

/// Links to the previous and next page of a list; `href` makes page N's link.
pub fn pager(page: u64, has_next: bool, href: impl Fn(u64) -> String) -> String {
    let mut out = String::from("<p class=pager>");
    if page > 0 {
        let _ = write!(out, "<a href=\"{}\">&larr; previous</a>", href(page - 1));
    }
    let _ = write!(out, "page {}", page + 1);
    if has_next {
        let _ = write!(out, " <a href=\"{}\">next &rarr;</a>", href(page + 1));
    }
    out.push_str("</p>");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_and_names_cannot_break_out_of_their_place() {
        assert_eq!(escape("<a href=\"x\">&'"), "&lt;a href=&quot;x&quot;&gt;&amp;&#39;");
        assert_eq!(segment("run 1/../x?y"), "run%201%2F..%2Fx%3Fy");
        assert_eq!(number(Some(0.12345)), "0.123");
        assert_eq!(number(Some(f64::NAN)), "-");
        assert_eq!(number(None), "-");
    }
}
