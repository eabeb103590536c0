//! Layers only look down: every `crate::` and `super::` path in `src/` (in `use`
//! declarations and inline in code; comments and string literals are skipped) is
//! resolved to the top-level module it reaches, and a module that reaches one above
//! it fails the test. The order (lowest first; modules on one line are side by side
//! and may not use each other):
//!
//! ```text
//! mlx
//! kernels
//! tokenizer, model_dir
//! models
//! engine
//! parallel
//! runtime
//! server
//! cli
//! ```
//!
//! Items of the crate root (`lib.rs`, e.g. `crate::cache_root`) may be used from
//! anywhere; the binaries (`main.rs`, `bin/`) sit above everything.
use std::path::{Path, PathBuf};

/// Each top-level module and its layer (higher may use lower).
const LAYERS: &[(&str, u32)] = &[
    ("mlx", 0),
    ("kernels", 1),
    ("tokenizer", 2),
    ("model_dir", 2),
    ("models", 3),
    ("engine", 4),
    ("parallel", 5),
    ("runtime", 6),
    ("server", 7),
    ("cli", 8),
];

fn layer(module: &str) -> Option<u32> {
    LAYERS.iter().find(|(m, _)| *m == module).map(|&(_, l)| l)
}

/// One path that reaches another top-level module.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Reach {
    line: usize,
    /// The top-level module reached (`None`: an item of the crate root).
    target: Option<String>,
    /// The path as written, up to the module reached.
    text: String,
}

/// Source text with comments and the contents of string and char literals blanked
/// (newlines kept, so line numbers stay).
fn strip(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    let blank = |c: u8| if c == b'\n' { b'\n' } else { b' ' };
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                out.push(b' ');
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                    depth += 1;
                    out.extend([b' ', b' ']);
                    i += 2;
                } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                    depth -= 1;
                    out.extend([b' ', b' ']);
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(b[i]));
                    i += 1;
                }
            }
        } else if c == b'r'
            && matches!(b.get(i + 1), Some(b'"') | Some(b'#'))
            && !ident_byte(prev(b, i))
        {
            // raw string r"..." / r#"..."#
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&b'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&b'"') {
                out.push(c);
                i += 1;
                continue;
            }
            out.extend(std::iter::repeat_n(b' ', j + 1 - i));
            i = j + 1;
            while i < b.len() {
                if b[i] == b'"' && (0..hashes).all(|h| b.get(i + 1 + h) == Some(&b'#')) {
                    out.extend(std::iter::repeat_n(b' ', 1 + hashes));
                    i += 1 + hashes;
                    break;
                }
                out.push(blank(b[i]));
                i += 1;
            }
        } else if c == b'"' {
            out.push(b' ');
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    out.push(b' ');
                    i += 1;
                }
                if i < b.len() {
                    out.push(blank(b[i]));
                    i += 1;
                }
            }
            out.push(b' ');
            i += 1;
        } else if c == b'\'' {
            // a char literal ('x', '\n', '\u{..}'), not a lifetime ('a)
            let end = if b.get(i + 1) == Some(&b'\\') {
                (i + 2..b.len().min(i + 12)).find(|&j| b[j] == b'\'')
            } else if b.get(i + 2) == Some(&b'\'') {
                Some(i + 2)
            } else {
                // multi-byte UTF-8 char
                (i + 2..b.len().min(i + 6)).find(|&j| b[j] == b'\'' && b[i + 1] >= 0x80)
            };
            match end {
                Some(e) => {
                    out.extend(std::iter::repeat_n(b' ', e + 1 - i));
                    i = e + 1;
                }
                None => {
                    out.push(c);
                    i += 1;
                }
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn prev(b: &[u8], i: usize) -> u8 {
    if i == 0 {
        b' '
    } else {
        b[i - 1]
    }
}

fn ident_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// The identifier starting at `i` (after spaces), and where it ends.
fn ident_at(b: &[u8], mut i: usize) -> (String, usize) {
    while i < b.len() && b[i].is_ascii_whitespace() {
        i += 1;
    }
    let s = i;
    while i < b.len() && ident_byte(b[i]) {
        i += 1;
    }
    (String::from_utf8_lossy(&b[s..i]).into_owned(), i)
}

/// Skip `::` (with spaces around) at `i`; `None` if there is none.
fn colons(b: &[u8], mut i: usize) -> Option<usize> {
    while i < b.len() && b[i].is_ascii_whitespace() {
        i += 1;
    }
    (b.get(i) == Some(&b':') && b.get(i + 1) == Some(&b':')).then_some(i + 2)
}

/// The first identifiers of the items of a `{ .. }` group starting at `i` (`i` at `{`).
fn group_heads(b: &[u8], i: usize) -> Vec<String> {
    let mut heads = Vec::new();
    let mut depth = 0;
    let mut expect = true;
    let mut j = i;
    while j < b.len() {
        match b[j] {
            b'{' => {
                depth += 1;
                if depth == 1 {
                    expect = true;
                }
            }
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    break;
                }
            }
            b',' if depth == 1 => expect = true,
            c if depth == 1 && expect && ident_byte(c) => {
                let (id, end) = ident_at(b, j);
                heads.push(id);
                expect = false;
                j = end;
                continue;
            }
            _ => {}
        }
        j += 1;
    }
    heads
}

/// Every path of `src` (the text of the file of module `module_path`, e.g. `["models",
/// "layers"]`; `[]` for the crate root) that reaches a top-level module or a root item.
fn reaches(src: &str, module_path: &[String]) -> Vec<Reach> {
    let text = strip(src);
    let b = text.as_bytes();
    // inline modules: (brace depth inside the module, its name)
    let mut inline: Vec<(usize, String)> = Vec::new();
    let mut depth = 0usize;
    let mut line = 1;
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'\n' {
            line += 1;
        }
        if c == b'{' {
            depth += 1;
        } else if c == b'}' {
            if inline.last().is_some_and(|(d, _)| *d == depth) {
                inline.pop();
            }
            depth = depth.saturating_sub(1);
        }
        if !ident_byte(c) || ident_byte(prev(b, i)) {
            i += 1;
            continue;
        }
        let (word, end) = ident_at(b, i);
        match word.as_str() {
            "mod" => {
                let (name, e2) = ident_at(b, end);
                let mut k = e2;
                while k < b.len() && b[k].is_ascii_whitespace() {
                    k += 1;
                }
                if !name.is_empty() && b.get(k) == Some(&b'{') {
                    inline.push((depth + 1, name));
                }
                i = e2;
                continue;
            }
            "crate" | "super" => {
                // the module this code is in: the file's path plus its inline modules
                let mut path: Vec<String> = module_path.to_vec();
                path.extend(inline.iter().map(|(_, n)| n.clone()));
                let mut at = end;
                let mut written = word.clone();
                let mut resolved: Vec<String> = if word == "crate" {
                    Vec::new()
                } else {
                    path.pop();
                    path.clone()
                };
                let mut ok = true;
                // `super::super::…`: one module up per `super`
                while word == "super" && ok {
                    let Some(after) = colons(b, at) else {
                        ok = false;
                        break;
                    };
                    let (next, e) = ident_at(b, after);
                    if next != "super" {
                        break;
                    }
                    resolved.pop();
                    written.push_str("::super");
                    at = e;
                }
                if !ok {
                    i = at;
                    continue;
                }
                if let Some(top) = resolved.first() {
                    // inside a top-level module: that is what the path reaches
                    out.push(Reach {
                        line,
                        target: Some(top.clone()),
                        text: written,
                    });
                    i = at;
                    continue;
                }
                // at the crate root: the next segment (or a group's segments) names it
                let Some(after) = colons(b, at) else {
                    i = at;
                    continue;
                };
                let mut k = after;
                while k < b.len() && b[k].is_ascii_whitespace() {
                    k += 1;
                }
                let heads = if b.get(k) == Some(&b'{') {
                    group_heads(b, k)
                } else {
                    vec![ident_at(b, k).0]
                };
                for h in heads.into_iter().filter(|h| !h.is_empty() && h != "self") {
                    let target = layer(&h).map(|_| h.clone());
                    out.push(Reach {
                        line,
                        target,
                        text: format!("{written}::{h}"),
                    });
                }
                i = k;
                continue;
            }
            _ => {
                i = end;
                continue;
            }
        }
    }
    out
}

/// The module path of a file under `src/` (`None` for the binaries).
fn module_path(rel: &Path) -> Option<Vec<String>> {
    let parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if parts == ["lib.rs"] {
        return Some(vec![]);
    }
    if parts[0] == "main.rs" || parts[0] == "bin" {
        return None;
    }
    let mut path: Vec<String> = parts
        .iter()
        .map(|p| p.strip_suffix(".rs").unwrap_or(p).to_string())
        .collect();
    if path.last().is_some_and(|l| l == "mod") {
        path.pop();
    }
    Some(path)
}

/// Every upward reach in one file, as messages.
fn violations(rel: &Path, src: &str) -> Vec<String> {
    let Some(path) = module_path(rel) else {
        return vec![];
    };
    let Some(from) = path.first() else {
        return vec![]; // the crate root declares everything
    };
    let Some(from_layer) = layer(from) else {
        return vec![format!(
            "src/{}: top-level module `{from}` has no layer in tests/layering.rs",
            rel.display()
        )];
    };
    reaches(src, &path)
        .into_iter()
        .filter_map(|r| {
            let to = r.target.as_deref()?;
            if to == from {
                return None;
            }
            let to_layer = layer(to)?;
            (to_layer >= from_layer).then(|| {
                format!(
                    "src/{}:{}: `{}` — {from} (layer {from_layer}) reaches {to} (layer {to_layer}); \
                     layers only look down",
                    rel.display(),
                    r.line,
                    r.text
                )
            })
        })
        .collect()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn modules_only_use_lower_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    assert!(
        files.len() > 20,
        "found only {} files under src/",
        files.len()
    );
    let mut bad = Vec::new();
    let mut seen = 0;
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap();
        let text = std::fs::read_to_string(f).unwrap();
        if let Some(p) = module_path(rel) {
            seen += reaches(&text, &p).len();
        }
        bad.extend(violations(rel, &text));
    }
    assert!(
        seen > 100,
        "only {seen} crate::/super:: paths found: is the scanner broken?"
    );
    assert!(
        bad.is_empty(),
        "{} upward path(s):\n{}",
        bad.len(),
        bad.join("\n")
    );
}

#[test]
fn every_top_level_module_has_a_layer() {
    let lib =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs")).unwrap();
    let mods: Vec<&str> = lib
        .lines()
        .filter_map(|l| l.trim().strip_prefix("pub mod "))
        .map(|m| m.trim_end_matches(';').trim())
        .collect();
    assert!(mods.contains(&"models"), "{mods:?}");
    for m in mods {
        assert!(
            layer(m).is_some(),
            "src/lib.rs declares `{m}`, which has no layer here"
        );
    }
}

#[test]
fn the_scanner_sees_use_inline_grouped_and_super_paths() {
    let p = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let src = r#"
use crate::engine::kv_cache::KvCache;
use crate::{mlx, server::Thing};
// use crate::cli::ignored;
fn f() -> usize { let s = "crate::cli::ignored"; crate::parallel::plan::x() + s.len() }
use super::layers::Linear;
mod tests {
    use super::super::super::cli::X;
}
"#;
    let r = reaches(src, &p(&["models", "transformer"]));
    let got: Vec<(usize, Option<&str>)> = r.iter().map(|r| (r.line, r.target.as_deref())).collect();
    assert_eq!(
        got,
        vec![
            (2, Some("engine")),
            (3, Some("mlx")),
            (3, Some("server")),
            (5, Some("parallel")),
            (6, Some("models")),
            (8, Some("cli")),
        ]
    );
    let v = violations(Path::new("models/transformer.rs"), src);
    assert_eq!(v.len(), 4, "{v:#?}");
    assert!(
        v[0].contains("src/models/transformer.rs:2") && v[0].contains("engine"),
        "{}",
        v[0]
    );
    // a lower module used from above, and the crate root's items, are fine
    let ok = "use crate::models::Model;\nfn g() { crate::cache_root(); }\n";
    assert!(violations(Path::new("engine/step.rs"), ok).is_empty());
    // side by side is not below
    let side = "use crate::model_dir::ModelDir;\n";
    assert_eq!(violations(Path::new("tokenizer/mod.rs"), side).len(), 1);
}
