//! A1 notation as the Sheets API reads it: `Sheet1`, `Sheet1!E5`,
//! `Sheet1!A2:C100`, `Sheet1!A1:F` (rows open), `'My Tab'!B:D` (columns),
//! `Sheet1!2:5` (rows), and a bare `A1:B2` on the first tab. Every input is
//! untrusted: parsing never panics and never overflows.

/// The most rows a range may name; Sheets holds at most 10 million cells.
const MAX_ROW: u32 = 10_000_000;
/// Column `ZZZ`, the last one a spreadsheet can have.
const MAX_COL: u32 = 18_278;

/// A range as written, before it meets a tab.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Range {
    /// The tab named before `!` (quotes removed), or the whole text when it
    /// has no `!`.
    pub tab: String,
    pub area: Area,
    /// For a text without `!` that also reads as cells (`A1:B2`): those
    /// cells on the first tab, meant when no tab has that name.
    pub or_first_tab: Option<Area>,
}

/// The cells of a range, 1-based and inclusive; `None` is open (the grid's
/// edge).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Area {
    /// The whole tab.
    Whole,
    /// One cell, which is also where a write larger than one cell starts.
    Cell { row: u32, col: u32 },
    Span {
        first_row: u32,
        first_col: u32,
        last_row: Option<u32>,
        last_col: Option<u32>,
    },
}

/// A range resolved on a tab of `rows` x `cols`: inclusive bounds, within
/// the grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Bounds {
    pub first_row: u32,
    pub first_col: u32,
    pub last_row: u32,
    pub last_col: u32,
}

/// One end of a span: its column letters and row digits, either of which
/// may be absent (`B`, `5`), not both.
#[derive(Debug, Clone, Copy)]
struct End {
    col: Option<u32>,
    row: Option<u32>,
}

/// Splits `text` into its tab and its cells. `None` when it cannot be read.
pub(crate) fn parse(text: &str) -> Option<Range> {
    let text = text.trim();
    if text.is_empty() {
        return None;
    }
    if let Some(quoted) = text.strip_prefix('\'') {
        let (tab, rest) = unquote(quoted)?;
        return match rest.strip_prefix('!') {
            None if rest.is_empty() => Some(Range {
                tab,
                area: Area::Whole,
                or_first_tab: None,
            }),
            None => None,
            Some(cells) => Some(Range {
                tab,
                area: cells_of(cells)?,
                or_first_tab: None,
            }),
        };
    }
    match text.split_once('!') {
        Some((tab, cells)) if !tab.is_empty() => Some(Range {
            tab: tab.to_owned(),
            area: cells_of(cells)?,
            or_first_tab: None,
        }),
        Some(_) => None,
        // A bare word is a tab's name, unless it reads as cells and the
        // spreadsheet has no tab of that name (the caller decides).
        None => Some(Range {
            tab: text.to_owned(),
            area: Area::Whole,
            or_first_tab: cells_of(text),
        }),
    }
}

/// A quoted tab name after its opening quote: the name (`''` is one quote)
/// and what follows the closing quote.
fn unquote(text: &str) -> Option<(String, &str)> {
    let mut name = String::new();
    let mut chars = text.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        if c == '\'' {
            if chars.peek().is_some_and(|(_, next)| *next == '\'') {
                chars.next();
                name.push('\'');
            } else {
                return (!name.is_empty()).then(|| (name, &text[i + 1..]));
            }
        } else {
            name.push(c);
        }
    }
    None
}

/// The cells part: `E5`, `A1:F100`, `A1:F`, `B:D`, `2:5`.
fn cells_of(text: &str) -> Option<Area> {
    match text.split_once(':') {
        None => {
            let end = end_of(text)?;
            Some(Area::Cell {
                row: end.row?,
                col: end.col?,
            })
        }
        Some((a, b)) => {
            let (a, b) = (end_of(a)?, end_of(b)?);
            // `A:5` mixes a column with a row: Sheets cannot read it.
            let columns_only = a.row.is_none() || b.row.is_none();
            let rows_only = a.col.is_none() || b.col.is_none();
            if columns_only && rows_only {
                return None;
            }
            let (first_row, last_row) = order(a.row, b.row);
            let (first_col, last_col) = order(a.col, b.col);
            Some(Area::Span {
                first_row: first_row.unwrap_or(1),
                first_col: first_col.unwrap_or(1),
                last_row,
                last_col,
            })
        }
    }
}

/// Both ends in order (`C1:A5` is `A1:C5`); an end absent on either side
/// leaves the span open on that side.
fn order(a: Option<u32>, b: Option<u32>) -> (Option<u32>, Option<u32>) {
    match (a, b) {
        (Some(a), Some(b)) => (Some(a.min(b)), Some(a.max(b))),
        (a, None) => (a, None),
        (None, b) => (b, None),
    }
}

/// `AB12`, `AB`, `12` (a `$` before either part is allowed, and ignored).
fn end_of(text: &str) -> Option<End> {
    let text = text.strip_prefix('$').unwrap_or(text);
    let letters = text.bytes().take_while(u8::is_ascii_alphabetic).count();
    let (col_part, rest) = text.split_at(letters);
    let row_part = rest.strip_prefix('$').unwrap_or(rest);
    if col_part.is_empty() && row_part.is_empty() {
        return None;
    }
    let col = if col_part.is_empty() {
        None
    } else {
        Some(column_number(col_part)?)
    };
    let row = if row_part.is_empty() {
        None
    } else {
        if !row_part.bytes().all(|b| b.is_ascii_digit()) || row_part.len() > 9 {
            return None;
        }
        let row: u32 = row_part.parse().ok()?;
        if row == 0 || row > MAX_ROW {
            return None;
        }
        Some(row)
    };
    Some(End { col, row })
}

/// `A` is 1, `Z` 26, `AA` 27.
pub(crate) fn column_number(letters: &str) -> Option<u32> {
    if letters.is_empty() || letters.len() > 3 {
        return None;
    }
    let mut n: u32 = 0;
    for b in letters.bytes() {
        if !b.is_ascii_alphabetic() {
            return None;
        }
        n = n * 26 + u32::from(b.to_ascii_uppercase() - b'A' + 1);
    }
    (n <= MAX_COL).then_some(n)
}

/// 1 is `A`, 27 `AA`.
pub(crate) fn column_letters(mut n: u32) -> String {
    let mut letters = Vec::new();
    while n > 0 {
        let rem = (n - 1) % 26;
        letters.push(char::from(b'A' + rem as u8));
        n = (n - 1) / 26;
    }
    letters.iter().rev().collect()
}

/// A tab's name as Sheets writes it in a range: quoted (`'My Tab'`) unless
/// it is a plain word that cannot be read as cells.
pub(crate) fn quote_tab(name: &str) -> String {
    let plain = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && cells_of(name).is_none();
    if plain {
        name.to_owned()
    } else {
        format!("'{}'", name.replace('\'', "''"))
    }
}

impl Area {
    /// The cells of this area on a grid of `rows` x `cols`, or `None` when
    /// it reaches past the grid's edge.
    pub(crate) fn bounds(&self, rows: u32, cols: u32) -> Option<Bounds> {
        let bounds = match *self {
            Area::Whole => Bounds {
                first_row: 1,
                first_col: 1,
                last_row: rows,
                last_col: cols,
            },
            Area::Cell { row, col } => Bounds {
                first_row: row,
                first_col: col,
                last_row: row,
                last_col: col,
            },
            Area::Span {
                first_row,
                first_col,
                last_row,
                last_col,
            } => Bounds {
                first_row,
                first_col,
                last_row: last_row.unwrap_or(rows),
                last_col: last_col.unwrap_or(cols),
            },
        };
        (bounds.last_row <= rows
            && bounds.last_col <= cols
            && bounds.first_row <= bounds.last_row
            && bounds.first_col <= bounds.last_col)
            .then_some(bounds)
    }

    /// The most rows and columns a write to this area may fill from its
    /// first cell (`None`: as many as the grid has). A single cell and a
    /// whole tab are anchors; a span is a limit.
    pub(crate) fn write_limit(&self) -> (Option<u32>, Option<u32>) {
        match *self {
            Area::Whole | Area::Cell { .. } => (None, None),
            Area::Span {
                first_row,
                first_col,
                last_row,
                last_col,
            } => (
                last_row.map(|r| r - first_row + 1),
                last_col.map(|c| c - first_col + 1),
            ),
        }
    }

    /// The first cell.
    pub(crate) fn origin(&self) -> (u32, u32) {
        match *self {
            Area::Whole => (1, 1),
            Area::Cell { row, col } => (row, col),
            Area::Span {
                first_row,
                first_col,
                ..
            } => (first_row, first_col),
        }
    }
}

/// `'My Tab'!B1:D1000`, or `Sheet1!E5` for one cell.
pub(crate) fn format(tab: &str, b: Bounds) -> String {
    let tab = quote_tab(tab);
    let first = format!("{}{}", column_letters(b.first_col), b.first_row);
    if b.first_row == b.last_row && b.first_col == b.last_col {
        format!("{tab}!{first}")
    } else {
        format!("{tab}!{first}:{}{}", column_letters(b.last_col), b.last_row)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(fr: u32, fc: u32, lr: Option<u32>, lc: Option<u32>) -> Area {
        Area::Span {
            first_row: fr,
            first_col: fc,
            last_row: lr,
            last_col: lc,
        }
    }

    #[test]
    fn ranges_of_every_shape_are_read() {
        let tab = |t: &str, area| Range {
            tab: t.to_owned(),
            area,
            or_first_tab: None,
        };
        assert_eq!(
            parse("Sheet1!A1:F"),
            Some(tab("Sheet1", span(1, 1, None, Some(6))))
        );
        assert_eq!(
            parse("Sheet1!A2:C100"),
            Some(tab("Sheet1", span(2, 1, Some(100), Some(3))))
        );
        assert_eq!(parse("Sheet1"), Some(tab("Sheet1", Area::Whole)));
        assert_eq!(
            parse("'My Tab'!B:D"),
            Some(tab("My Tab", span(1, 2, None, Some(4))))
        );
        assert_eq!(
            parse("Sheet1!E5"),
            Some(tab("Sheet1", Area::Cell { row: 5, col: 5 }))
        );
        assert_eq!(
            parse("'It''s'!2:5"),
            Some(tab("It's", span(2, 1, Some(5), None)))
        );
        assert_eq!(parse("'My Tab'"), Some(tab("My Tab", Area::Whole)));
        assert_eq!(
            parse("C5:A1"),
            Some(Range {
                tab: "C5:A1".to_owned(),
                area: Area::Whole,
                or_first_tab: Some(span(1, 1, Some(5), Some(3)))
            })
        );
    }

    #[test]
    fn unreadable_ranges_are_refused_without_panicking() {
        for bad in [
            "",
            "!",
            "!A1",
            "Sheet1!",
            "Sheet1!A0",
            "Sheet1!A1:",
            "Sheet1!:B2",
            "Sheet1!A:5",
            "Sheet1!AAAA1",
            "Sheet1!A99999999999",
            "'unclosed",
            "'x'A1",
            "''!A1",
            "Sheet1!A1:B2:C3",
            "Sheet1!é1",
            "Sheet1!1A",
        ] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn columns_are_numbered_as_sheets_numbers_them() {
        for (letters, n) in [("A", 1), ("Z", 26), ("AA", 27), ("AZ", 52), ("ZZZ", 18_278)] {
            assert_eq!(column_number(letters), Some(n));
            assert_eq!(column_letters(n), letters);
        }
        assert_eq!(quote_tab("Sheet1"), "Sheet1");
        assert_eq!(quote_tab("My Tab"), "'My Tab'");
        assert_eq!(quote_tab("A1"), "'A1'");
        assert_eq!(quote_tab("it's"), "'it''s'");
    }

    #[test]
    fn bounds_stay_within_the_grid() {
        assert_eq!(
            span(2, 1, None, Some(6)).bounds(1000, 26),
            Some(Bounds {
                first_row: 2,
                first_col: 1,
                last_row: 1000,
                last_col: 6
            })
        );
        assert_eq!(span(1, 1, Some(1001), Some(2)).bounds(1000, 26), None);
        assert_eq!(span(1, 1, None, Some(27)).bounds(1000, 26), None);
    }
}
