//! A tab's rows as items. Each row from `first_row` on (each block of it,
//! with `blocks`) is an item whose fields are the cells of its columns, as
//! the sheet shows them (text); an item whose cells are all empty is none.
//! Its id names its place: `r5`, or `r5b2` for row 5's second block, so
//! that its results go back to the same cells.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use super::{SheetError, SheetsApi, a1, tab};
use evalfleet_config::{DatasetConfig, SheetConfig, column_letters};
use evalfleet_io::dataset::Row;

/// An item's place in the sheet: its row (from 1) and block (from 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Place {
    pub row: u32,
    pub block: u32,
}

impl Place {
    pub fn id(self, blocks: bool) -> String {
        if blocks {
            format!("r{}b{}", self.row, self.block + 1)
        } else {
            format!("r{}", self.row)
        }
    }

    /// The place an item id names.
    pub fn of_id(id: &str) -> Option<Self> {
        let rest = id.strip_prefix('r')?;
        let (row, block) = match rest.split_once('b') {
            Some((row, block)) => (row, block.parse::<u32>().ok()?.checked_sub(1)?),
            None => (rest, 0),
        };
        Some(Self {
            row: row.parse().ok()?,
            block,
        })
    }
}

/// The items of a tab, by place.
#[derive(Debug, Default)]
pub struct SheetItems {
    pub items: BTreeMap<Place, Row>,
    /// The fields read, and their columns (of the first block).
    pub fields: Vec<(String, u32)>,
}

/// Reads `config`'s rows through `api`.
pub async fn read(api: &SheetsApi, config: &SheetConfig) -> Result<SheetItems, SheetError> {
    let fields = if config.columns.is_empty() {
        // The header names the fields: its row first, then only their
        // columns (not the results written beside them).
        let header = config.header_row;
        let row = api
            .get(&format!("{}!{header}:{header}", tab(&config.tab)), false)
            .await?;
        header_fields(config, row.first().map_or(&[][..], Vec::as_slice))?
    } else {
        config.columns.clone()
    };
    let last_column = fields_width(config, &fields) - 1;
    let range = a1(
        &config.tab,
        (0, config.first_row),
        Some((last_column, config.last_row)),
    );
    let grid = api.get(&range, false).await?;
    Ok(SheetItems {
        items: items_of(config, &fields, &grid, config.first_row),
        fields,
    })
}

/// The first column past every field's, over all the blocks.
fn fields_width(config: &SheetConfig, fields: &[(String, u32)]) -> u32 {
    let moving = config.blocks.as_ref();
    fields
        .iter()
        .map(|(name, c)| match moving {
            Some(b) if b.fields.contains(name) => c + (b.count - 1) * b.stride + 1,
            _ => c + 1,
        })
        .max()
        .unwrap_or(1)
}

/// The items of `grid`, the cells of `fields` from row `top` on.
pub fn items_of(
    config: &SheetConfig,
    fields: &[(String, u32)],
    grid: &[Vec<Value>],
    top: u32,
) -> BTreeMap<Place, Row> {
    let blocks = config.blocks.as_ref();
    let mut items = BTreeMap::new();
    for (i, cells) in grid.iter().enumerate() {
        let row = top + u32::try_from(i).unwrap_or(u32::MAX);
        if row < config.first_row || config.last_row.is_some_and(|last| row > last) {
            continue;
        }
        for block in 0..blocks.map_or(1, |b| b.count) {
            let mut item = Map::new();
            let mut any = false;
            for (name, column) in fields {
                let moves = blocks.is_some_and(|b| b.fields.contains(name));
                let column = match blocks {
                    Some(b) if moves => column + block * b.stride,
                    _ => *column,
                };
                let text = cell_text(cells.get(column as usize));
                // A block is an item when a cell of its own holds a value;
                // without blocks, when any cell does.
                if !text.is_empty() && (moves || blocks.is_none()) {
                    any = true;
                }
                item.insert(name.clone(), Value::String(text));
            }
            if any {
                let place = Place { row, block };
                item.insert(
                    evalfleet_config::SHEET_ID_FIELD.to_owned(),
                    Value::String(place.id(blocks.is_some())),
                );
                items.insert(place, item);
            }
        }
    }
    items
}

/// A cell as text, as the sheet shows it (`FORMATTED_VALUE` gives text;
/// anything else is written as JSON would).
fn cell_text(cell: Option<&Value>) -> String {
    match cell {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    }
}

/// The fields the header row names: every column with a name, but those
/// results are written to.
fn header_fields(config: &SheetConfig, header: &[Value]) -> Result<Vec<(String, u32)>, SheetError> {
    let mut fields: Vec<(String, u32)> = Vec::new();
    for (i, cell) in header.iter().enumerate() {
        let column = u32::try_from(i).unwrap_or(u32::MAX);
        let name = cell_text(Some(cell)).trim().to_owned();
        if name.is_empty() || config.write.iter().any(|(c, _)| *c == column) {
            continue;
        }
        if let Some((_, first)) = fields.iter().find(|(n, _)| *n == name) {
            return Err(SheetError::Sheet(format!(
                "tab '{}', row {}: the name '{name}' heads columns {} and {}; name the fields with dataset.sheet.columns",
                config.tab,
                config.header_row,
                column_letters(*first),
                column_letters(column)
            )));
        }
        fields.push((name, column));
    }
    if fields.is_empty() {
        return Err(SheetError::Sheet(format!(
            "tab '{}', row {}: the header row names no column; set dataset.sheet.header_row or name the fields with dataset.sheet.columns",
            config.tab, config.header_row
        )));
    }
    Ok(fields)
}

/// Reads the sheet of `dataset` (when it is one) into a file of the
/// snapshot folder named after its content, which becomes the dataset's
/// `path`: a file is never rewritten with other rows (runs read their rows
/// again by offset while they go on), and a resume that reads the same
/// rows finds the same file. Returns how many items it holds.
pub async fn read_dataset(dataset: &mut DatasetConfig) -> Result<Option<usize>, SheetError> {
    let Some(config) = &dataset.sheet else {
        return Ok(None);
    };
    let api = SheetsApi::open(config, false)?;
    let read = read(&api, config).await?;
    if read.items.is_empty() {
        return Err(SheetError::Sheet(format!(
            "tab '{}' of spreadsheet {} has no item from row {}{} (rows whose columns {} are all empty are none)",
            config.tab,
            config.spreadsheet_id,
            config.first_row,
            config
                .last_row
                .map(|l| format!(" to row {l}"))
                .unwrap_or_default(),
            read.fields
                .iter()
                .map(|(_, c)| column_letters(*c))
                .collect::<Vec<_>>()
                .join(", "),
        )));
    }
    let mut text = Vec::new();
    for item in read.items.values() {
        serde_json::to_writer(&mut text, item).map_err(|err| SheetError::Sheet(err.to_string()))?;
        text.push(b'\n');
    }
    let dir = evalfleet_config::snapshot_dir();
    let digest = hex::encode(Sha256::digest(&text));
    let path = dir.join(format!("sheet-{}.jsonl", &digest[..32]));
    keep(&dir, &path, &text).map_err(|source| SheetError::Snapshot {
        path: path.clone(),
        source,
    })?;
    dataset.path = path;
    Ok(Some(read.items.len()))
}

/// The items of a dataset file `read_dataset` wrote, by place.
pub fn rows_of_file(path: &Path) -> Result<BTreeMap<Place, Row>, SheetError> {
    let text = std::fs::read_to_string(path).map_err(|source| SheetError::Snapshot {
        path: path.to_owned(),
        source,
    })?;
    Ok(text
        .lines()
        .filter_map(|line| serde_json::from_str::<Row>(line).ok())
        .filter_map(|row| {
            let id = row.get(evalfleet_config::SHEET_ID_FIELD)?.as_str()?;
            Some((Place::of_id(id)?, row))
        })
        .collect())
}

/// Writes `text` to `path` in `dir` (made readable by its owner only)
/// unless it is there already.
fn keep(dir: &Path, path: &Path, text: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    if std::fs::read(path).is_ok_and(|held| held == text) {
        return Ok(());
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    let partial = path.with_extension(format!("{}.part", std::process::id()));
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&partial)?;
    file.write_all(text)?;
    file.sync_all()?;
    std::fs::rename(&partial, path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use evalfleet_config::{Blocks, WriteValue};
    use serde_json::json;

    fn config() -> SheetConfig {
        SheetConfig {
            write: vec![(3, WriteValue::Answer)],
            ..crate::test_config()
        }
    }

    #[test]
    fn places_and_ids_round_trip() {
        for (place, blocks, id) in [
            (Place { row: 5, block: 0 }, false, "r5"),
            (Place { row: 12, block: 1 }, true, "r12b2"),
        ] {
            assert_eq!(place.id(blocks), id);
            assert_eq!(Place::of_id(id), Some(place));
        }
        for bad in ["5", "r", "rb1", "r5b0", "r5bx", "x5"] {
            assert_eq!(Place::of_id(bad), None, "{bad}");
        }
    }

    #[test]
    fn header_names_the_fields_but_not_the_written_columns() {
        let grid = [
            vec![json!("q"), json!("ref"), json!(""), json!("answer")],
            vec![json!("1+1"), json!("2"), json!(""), json!("old")],
            vec![],
            vec![json!("2+2")],
        ];
        let fields = header_fields(&config(), &grid[0]).unwrap_or_default();
        assert_eq!(fields, vec![("q".to_owned(), 0), ("ref".to_owned(), 1)]);
        let read = items_of(&config(), &fields, &grid[1..], 2);
        let items: Vec<&Row> = read.values().collect();
        assert_eq!(items.len(), 2, "the empty row 3 is no item");
        assert_eq!(
            Value::Object(items[0].clone()),
            json!({"q": "1+1", "ref": "2", "_id": "r2"})
        );
        assert_eq!(
            Value::Object(items[1].clone()),
            json!({"q": "2+2", "ref": "", "_id": "r4"})
        );
        let twice = vec![json!("q"), json!("q")];
        let err = header_fields(&config(), &twice)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("heads columns A and B"), "{err}");
    }

    #[test]
    fn blocks_move_their_fields_and_empty_blocks_are_no_items() {
        let mut config = config();
        config.columns = vec![("text".to_owned(), 0), ("category".to_owned(), 1)];
        config.blocks = Some(Blocks {
            count: 3,
            stride: 2,
            fields: vec!["category".to_owned()],
        });
        config.write = vec![(2, WriteValue::Answer)];
        let grid = [
            vec![
                json!("text"),
                json!("c1"),
                json!("s1"),
                json!("c2"),
                json!("s2"),
                json!("c3"),
            ],
            vec![json!("hello"), json!("tone"), json!(""), json!("topic")],
            vec![json!("no blocks")],
        ];
        assert_eq!(
            fields_width(&config, &config.columns),
            6,
            "block 3's category is in F"
        );
        let read = items_of(&config, &config.columns, &grid[1..], 2);
        let ids: Vec<String> = read.keys().map(|p| p.id(true)).collect();
        assert_eq!(ids, ["r2b1", "r2b2"]);
        let second = &read[&Place { row: 2, block: 1 }];
        assert_eq!(second["category"], json!("topic"));
        assert_eq!(second["text"], json!("hello"));
    }
}
