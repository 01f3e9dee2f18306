"""Google's own client (google-auth, from PyPI) against the Sheets stand-in:
a service account's token by the JWT bearer grant, then a read and a write
through AuthorizedSession. Prints one JSON object of what it saw.

    python sheets_gauth.py KEY_JSON_FILE BASE_URL SPREADSHEET_ID
"""
import json
import sys
import urllib.parse

from google.auth.transport.requests import AuthorizedSession
from google.oauth2 import service_account

key_file, base, spreadsheet = sys.argv[1:4]
with open(key_file) as f:
    info = json.load(f)
credentials = service_account.Credentials.from_service_account_info(
    info, scopes=["https://www.googleapis.com/auth/spreadsheets"]
)
session = AuthorizedSession(credentials)
values = f"{base}/v4/spreadsheets/{spreadsheet}/values"

read = session.get(
    f"{values}/{urllib.parse.quote('Data!A1:C', safe='')}",
    params={"valueRenderOption": "UNFORMATTED_VALUE"},
)
write = session.post(
    f"{values}:batchUpdate",
    json={
        "valueInputOption": "RAW",
        "data": [{"range": "Data!D2:D3", "majorDimension": "ROWS", "values": [[0.75], ["done"]]}],
    },
)
print(
    json.dumps(
        {
            "read_status": read.status_code,
            "read": read.json(),
            "write_status": write.status_code,
            "write": write.json(),
            "token_valid": credentials.valid,
        }
    )
)
